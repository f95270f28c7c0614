"""``PlanOptions``: everything that shapes a plan, in one record every entry point takes.

``optimize``, ``prepare``, ``plan_for``, ``sweep``, ``optimize_compiled``, ``enable``, ``plan_on_rank0``,
``profile`` and ``Plan.apply`` accept ``options=PlanOptions(...)`` and the same names as keyword arguments,
which override it (``resolve``). What each entry point accepts is derived from the fields themselves: each
field says whether it is fixed when a model is prepared (captured and profiled) and which entry points it
does not apply to, with why. A name that is not an option, or an option set for an entry point it does
not apply to, is a one-line ``OptionError``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, TypedDict

from planner.capture.step import LossFn
from planner.common.budget import BudgetBounds
from planner.common.loop import OptimizerState, TrainingLoop, ZeroGrad
from planner.errors import OptionError
from planner.follow.shapes import ShapeRange, check_spec
from planner.memory.pipeline import Pipeline, Schedule
from planner.profiling.record import Profile

_ENABLE = {"enable": "it plans the model for this process and its own device (optimize() plans for another device "
                     "or a distributed job)"}
_COMPILED = {"optimize_compiled": "it compiles and measures every partition here, on one device, without an optimizer"}
_ONE_SHAPE = {"optimize_compiled": "a compiled partition is made for one shape"}
_PROFILE = {"profile": "profile() measures one step as it is; pass it to optimize() or prepare()"}
_APPLY = {"Plan.apply": "a saved plan is applied as it was made; plan again to change it"}
_PLANNING = {**_PROFILE, **_APPLY}
"""The entry points an option does not apply to (``resolve``'s ``where``), with why: options only planning
reads (not ``profile()`` nor ``Plan.apply``), options that plan for another device or a job (not ``enable``
nor ``optimize_compiled``), options for several shapes (not ``optimize_compiled``)."""


def _option(default: Any, *, prepared: bool, refused: Mapping[str, str] | None = None,
            neutral: tuple[Any, ...] = ()) -> Any:
    """A ``PlanOptions`` field: ``prepared``, whether it is fixed when a model is prepared (captured and
    profiled; ``plan_for`` then refuses a different value); ``refused``, the entry points it does not apply to
    (``resolve``'s ``where``), each with why; ``neutral``, values besides the default that ask those entry points
    for nothing they do not do anyway (``follow_batch=False``)."""
    return field(default=default, metadata={"prepared": prepared, "refused": dict(refused or {}),
                                            "neutral": neutral})


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanOptions:
    """What shapes a plan besides the model, its inputs and the budget. Every field has the default
    ``optimize`` uses."""

    loss_fn: LossFn | None = _option(None, prepared=True)
    """``output -> scalar`` differentiated by a step; default ``output.loss`` or the sum of the floating outputs."""
    keep_output: bool = _option(True, prepared=True, refused=_APPLY)
    """Whether the training loop keeps the model's output referenced through backward (a plain loop);
    False for loops that drop it first, as Hugging Face ``Trainer`` does. In a pipeline stage (``pipeline``) the
    schedule holds each microbatch's output until its backward either way; on the last stage False means the
    schedule returns no outputs (``step(..., return_outputs=False)``, as torchtitan calls it), True that it keeps
    every microbatch's to return them merged."""
    solver: str = _option("cpsat", prepared=False, refused=_PLANNING)
    """Planning strategy, one of ``planner.solve.registry.SOLVERS``."""
    time_limit_s: float = _option(30.0, prepared=False, refused=_PLANNING)
    """Seconds the solve stage may take, all of it; past it the best plan found is returned (FEASIBLE)."""
    max_chunks: int | None = _option(None, prepared=False, refused=_PLANNING)
    """Most cut positions the search starts with (finer chunkings follow while they pay); None: 64, or two per
    repeated block for a model of 33 to 128 (``planner.memory.regions.DEFAULT_CHUNKS``)."""
    selective: bool = _option(True, prepared=False, refused=_PLANNING)
    """Let checkpointed segments keep chosen op outputs (torch's selective checkpointing)."""
    must_save: tuple[str, ...] = _option((), prepared=False, refused=_PLANNING)
    """Module paths or op names (``planner.common.patterns`` globs) never re-run in backward."""
    must_recompute: tuple[str, ...] = _option((), prepared=False, refused=_PLANNING)
    """Module paths or op names (``planner.common.patterns`` globs) re-run in backward, never kept."""
    profile: Profile | None = _option(None, prepared=True, refused={**_PLANNING, **_COMPILED})
    """A saved profile to plan from instead of profiling."""
    device: str | None = _option(None, prepared=True, refused={**_ENABLE, **_COMPILED, **_APPLY})
    """Plan for this device without it: a spec name (``"h100"``) or a spec file; None: measure where the
    model is."""
    world_size: int = _option(1, prepared=True, refused={**_ENABLE, **_COMPILED, **_PLANNING})
    """Plan for one rank of a job on this many ranks."""
    parallel: str | None = _option(None, prepared=True, refused={**_ENABLE, **_COMPILED, **_PLANNING})
    """``fsdp`` (default when ``world_size`` > 1) or ``ddp``."""
    tensor_parallel: int = _option(1, prepared=True, refused={**_ENABLE, **_COMPILED, **_PLANNING})
    """Plan one rank of a job that also splits each layer over this many ranks by tensor parallelism (heads and
    MLP width; a Hugging Face config's ``base_model_tp_plan``), estimated on the meta device for ``device=``
    (``planner.distributed.tensor``); ``world_size`` then counts the data-parallel ranks. For a model already
    parallelised with ``parallelize_module``, plan on its ranks with ``plan_on_rank0`` instead."""
    units: tuple[str, ...] | None = _option(None, prepared=True, refused={**_COMPILED, **_PROFILE})
    """FSDP units (module paths or globs); default the model's repeated blocks."""
    optimizer: Any = _option(None, prepared=True, refused={**_COMPILED, **_PLANNING})
    """Count its state and its step in the budget: the optimizer object itself (its kind, hyperparameters and the
    parameters it holds are read, its step measured on meta tensors: ``planner.profiling.optimizer``), a name
    (``adamw``, ``adam``, ``sgd``, ``sgd-momentum``), or the bytes of its state."""
    gradient_accumulation_steps: int = _option(1, prepared=True, refused={**_COMPILED, **_PLANNING})
    """Micro-steps per optimizer step (Trainer's and accelerate's ``gradient_accumulation_steps``, Lightning's
    ``accumulate_grad_batches``): from the second on, the earlier gradients are alive through forward and backward."""
    batches_held: int = _option(1, prepared=True, refused={**_COMPILED, **_PLANNING})
    """Micro-batches the loop holds on the device at once: Trainer (and TRL) takes the ``gradient_accumulation_steps``
    batches of an optimizer step from its loader together, to count their tokens, and holds them all through the
    step (its callback sets this); a loop that makes each batch in turn holds 1."""
    zero_grad: ZeroGrad = _option(ZeroGrad.BEFORE_FORWARD, prepared=True, refused={**_COMPILED, **_PLANNING})
    """Where the loop clears the last step's gradients: ``before_forward`` (after ``optimizer.step()``, plain
    loops, Trainer) or ``before_backward`` (Lightning: the last step's gradients are alive through the forward)."""
    set_to_none: bool = _option(True, prepared=True, refused={**_COMPILED, **_PLANNING})
    """The loop's ``zero_grad(set_to_none=...)``: False keeps zero-filled gradients alive through every step."""
    autocast: Any = _option(None, prepared=True, refused={**_COMPILED, **_APPLY})
    """The ``torch.autocast`` dtype the training step runs under (``"bf16"``, ``"fp16"`` or the dtype): capture and
    profile run under it; None: as the caller runs them (inside its own ``torch.autocast`` or not)."""
    mixed_precision: Any = _option(None, prepared=True, refused={**_ENABLE, **_COMPILED, **_PLANNING})
    """FSDP2's ``MixedPrecisionPolicy`` the job trains with (``param_dtype``, ``reduce_dtype``,
    ``cast_forward_inputs``): the step is profiled in ``param_dtype`` and the budget counts fp32 shards and
    optimizer state, gathered units in ``param_dtype`` and gradients reduced in ``reduce_dtype``."""
    follow_batch: bool | None = _option(None, prepared=True, refused={**_ONE_SHAPE, **_PLANNING}, neutral=(False,))
    """Each training call runs the plan of its own shape's group (``planner.follow.family``): no checkpoint where the
    un-checkpointed step fits, lighter plans for smaller batches, groups planned when first seen. The plan
    runs the model's own forward (module hooks). On a DDP rank (``parallel="ddp"``) each rank runs the plan
    of its own batch's group; not on FSDP ranks. None (default): follow wherever it costs nothing to say so and
    nothing can go wrong (``planner.pipeline.follows``: a plan already run by module hooks, such as every
    Hugging Face model's and ``enable``'s, whose loss is the model's own output, on one process or DDP
    ranks); False: one plan, made for the example's shape, runs on every call."""
    shapes: tuple[Any, ...] | None = _option(None, prepared=True, refused={**_ONE_SHAPE, **_PLANNING})
    """Shapes of calls to plan ahead, when following the batch (implied): each a shape such as ``(4, 128)``,
    given to every tensor argument shaped like the example's largest, or a ``{argument: shape}`` dict.
    Each is made from the example batch's values (cut, or grown by repeating the last slice). A
    ``ShapeRange((4, 64), (4, 512))`` plans every group between the two."""
    offload: bool | str | None = _option(None, prepared=False, refused={**_PLANNING, **_COMPILED}, neutral=(False,))
    """Let the plan copy kept activations to host memory and back (``docs/offload.md``): ``"auto"`` or True, on; False,
    off; None (default): on where the device has a host link that runs beside compute (a GPU, or a GPU's spec with
    ``device=``), off on a CPU (where ``"auto"`` is refused: host memory is the CPU's own, nothing would be freed).
    A plan that follows the batch chooses each shape group's offloads with its plan."""
    host_budget: int | str | None = _option(None, prepared=False, refused={**_PLANNING, **_COMPILED})
    """Most pinned host memory the plan's offloaded activations may hold, per rank (``"64GB"``, bytes); pinned memory
    cannot be swapped out. None: the host's share (``ranks_per_host``): half of its memory (the device spec's
    ``host_memory_bytes``, or this machine's when planning on its GPU) split among its ranks."""
    ranks_per_host: int | None = _option(None, prepared=False, refused={**_PLANNING, **_COMPILED})
    """Ranks of the job whose offloads share one host: its memory's bandwidth (each rank's copies get at most an
    equal share of the spec's ``host_memory_bandwidth_gb_per_s``) and its pinned memory (``host_budget``). None:
    for a device spec, the job's ranks (``world_size`` x ``tensor_parallel``) up to the spec's ``gpus_per_host``;
    on a GPU, torchrun's ``LOCAL_WORLD_SIZE``, else 1."""
    budget_bounds: BudgetBounds = _option(BudgetBounds.RESERVED, prepared=False, refused={**_PLANNING, **_COMPILED})
    """On a GPU (``cuda`` or a GPU's spec): ``"reserved"`` (default), the plan's step fits the budget as the CUDA
    caching allocator reserves it (its rounding and segments, ``docs/memory-model.md``), which is what runs out;
    ``"allocated"``, the budget bounds what it allocates (``max_memory_allocated``). On a CPU, what is allocated."""
    compilable: bool = _option(False, prepared=True, refused=_PROFILE, neutral=(False,))
    """Plan for ``torch.compile``: a plan run by module hooks (Hugging Face models, ``enable``, plans that follow the
    batch) gets segments of one module call each (a layer, its MLP, its attention), which compiled code runs through
    ``torch.utils.checkpoint`` in one graph; a segment of several calls cannot be compiled. A rewritten graph
    (torch.fx) compiles either way (``docs/compiled.md``)."""
    pipeline: Any = _option(None, prepared=False, refused={**_PLANNING, **_COMPILED})
    """Plan one stage of a pipeline-parallel job (``planner.memory.pipeline``): a ``Pipeline`` or
    ``"SCHEDULE:STAGES:MICROBATCHES[:CHUNKS]"`` (``"1f1b:4:8"``; schedules ``gpipe``, ``1f1b``,
    ``interleaved_1f1b``). The model is the stage's module and ``inputs`` one microbatch of it; the budget bounds the
    stage with every microbatch its schedule keeps in flight at ``pipeline_rank`` (the first stage holds the most
    under 1F1B); from the first backward on, the microbatches' gradients accumulate in the parameters'. On the
    ranks of an FSDP job (``world_size``), every unit stays gathered through the stage's microbatches and their
    gradients accumulate un-sharded, as torch.distributed.pipelining runs FSDP2. None: no pipeline."""
    pipeline_rank: int = _option(0, prepared=False, refused={**_PLANNING, **_COMPILED})
    """The stage's place in the pipeline, 0 for the first (with ``pipeline``)."""
    compile_backend: str | None = _option(None, prepared=True, refused={**_PLANNING, **_COMPILED})
    """The ``torch.compile`` backend the training step runs under (``"inductor"``, its default; ``"aot_eager"``...),
    None for an eager step. The plan then compiles (``compilable``) and is fitted to the compiled step as measured
    here, at the allocator (``planner.compiled.step``): inductor fuses and reorders, so the eager prediction is not
    what the compiled step holds. It is made for the example's shape (no ``follow_batch``), without offloads, on
    the device the model is on (no ``device``, ``world_size`` nor ``tensor_parallel``)."""
    progress: Callable[[str], None] | None = _option(None, prepared=False)
    """Called with the name of each stage as it starts (``capture``, ``profile``, ``solve``, ``rewrite``)."""

    def __post_init__(self) -> None:
        """Normalises pattern lists to tuples and checks the numbers, so that every entry point refuses a bad
        option before any work."""
        for name in ("must_save", "must_recompute", "units"):  # a single pattern, or any sequence of them
            value = getattr(self, name)
            if isinstance(value, str):
                object.__setattr__(self, name, (value,))
            elif value is not None and not isinstance(value, tuple) and isinstance(value, Sequence | set):
                object.__setattr__(self, name, tuple(value))
        if self.max_chunks is not None and (isinstance(self.max_chunks, bool) or not isinstance(self.max_chunks, int)
                                            or self.max_chunks < 1):
            raise OptionError(f"max_chunks must be an int >= 1 (got {self.max_chunks!r}); e.g. max_chunks=128 for "
                              "finer plans")
        _check_count("world_size", self.world_size, "the number of ranks")
        _check_count("tensor_parallel", self.tensor_parallel, "the ranks each layer is split over")
        if self.shapes is not None:
            specs = [self.shapes] if isinstance(self.shapes, Mapping | ShapeRange) else list(self.shapes)
            if specs and all(isinstance(d, int) and not isinstance(d, bool) for d in specs):
                specs = [tuple(specs)]  # one shape given bare: shapes=(4, 128)
            object.__setattr__(self, "shapes", tuple(check_spec(spec) for spec in specs))
            object.__setattr__(self, "follow_batch", True)
        if self.follow_batch and self.sharded:
            raise OptionError(f"follow_batch cannot follow the batch on the ranks of an FSDP job (world_size="
                              f"{self.world_size}): plan for one shape, or follow the batch with parallel='ddp'")
        _check_count("gradient_accumulation_steps", self.gradient_accumulation_steps, "micro-steps per optimizer step")
        if self.gradient_accumulation_steps > 1 and self.sharded:
            raise OptionError("gradient_accumulation_steps > 1 is not modelled on the ranks of an FSDP job: plan each "
                              "micro-step's budget without it, or accumulate under parallel='ddp'")
        _check_count("batches_held", self.batches_held, "micro-batches the loop holds at once")
        if not isinstance(self.zero_grad, ZeroGrad):
            choices = ", ".join(repr(z.value) for z in ZeroGrad)
            try:
                object.__setattr__(self, "zero_grad", ZeroGrad(self.zero_grad))
            except ValueError:
                raise OptionError(f"zero_grad must be one of {choices} (where the loop clears the gradients), got "
                                  f"{self.zero_grad!r}") from None
        if not isinstance(self.budget_bounds, BudgetBounds):
            try:
                object.__setattr__(self, "budget_bounds", BudgetBounds(self.budget_bounds))
            except ValueError:
                raise OptionError(f"budget_bounds must be 'reserved' or 'allocated' (what a budget on a GPU bounds), "
                                  f"got {self.budget_bounds!r}") from None
        if not isinstance(self.set_to_none, bool):
            raise OptionError(f"set_to_none must be True or False (the loop's zero_grad(set_to_none=...)), got "
                              f"{self.set_to_none!r}")
        if self.autocast is not None:
            object.__setattr__(self, "autocast", autocast_dtype(self.autocast))
        if self.offload == "auto":
            object.__setattr__(self, "offload", True)
        if self.offload is not None and not isinstance(self.offload, bool):
            raise OptionError(f"offload must be 'auto' (or True), False or None (on where the device has a host link), "
                              f"got {self.offload!r}")
        if self.host_budget is not None:
            object.__setattr__(self, "host_budget", _host_bytes(self.host_budget))
        if self.ranks_per_host is not None:
            _check_count("ranks_per_host", self.ranks_per_host, "the ranks whose offloads share one host")
        if self.compile_backend is not None:
            self._for_compiled_step()
        if self.pipeline is not None:
            self._for_a_pipeline()
        limit = self.time_limit_s
        if isinstance(limit, bool) or not isinstance(limit, int | float) or not 0 <= limit < float("inf"):
            raise OptionError(f"time_limit_s must be a number of seconds >= 0 (got {limit!r}); e.g. time_limit_s=60")

    def _for_compiled_step(self) -> None:
        """Checks ``compile_backend`` against the options it excludes, and sets those it implies."""
        import torch

        if not isinstance(self.compile_backend, str) or \
                self.compile_backend not in torch.compiler.list_backends(exclude_tags=()):
            raise OptionError(f"compile_backend must be the name of a torch.compile backend (one of "
                              f"{', '.join(torch.compiler.list_backends())}), got {self.compile_backend!r}")
        other = ("device" if self.device is not None else "world_size" if self.world_size > 1
                 else "tensor_parallel" if self.tensor_parallel > 1 else "follow_batch" if self.follow_batch
                 else "offload" if self.offload else None)
        if other is not None:
            raise OptionError(f"compile_backend= fits the plan to the compiled step measured on this device, for "
                              f"one shape, without offloads: drop {other}=, or plan the eager step with "
                              f"compilable=True")
        for name, value in (("compilable", True), ("follow_batch", False), ("offload", False)):
            object.__setattr__(self, name, value)

    def _for_a_pipeline(self) -> None:
        """Reads ``pipeline`` (a ``Pipeline`` or its text form) and checks ``pipeline_rank`` against it."""
        if isinstance(self.pipeline, str):
            object.__setattr__(self, "pipeline", parse_pipeline(self.pipeline))
        if not isinstance(self.pipeline, Pipeline):
            raise OptionError(f"pipeline must be a planner.Pipeline or 'SCHEDULE:STAGES:MICROBATCHES[:CHUNKS]' "
                              f"('1f1b:4:8'), got {self.pipeline!r}")
        rank = self.pipeline_rank
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.pipeline.stages:
            raise OptionError(f"pipeline_rank must be a stage of the pipeline, 0 to {self.pipeline.stages - 1}, got "
                              f"{rank!r}")

    def loop(self, *, optimizer: OptimizerState | None, autocast: Any) -> TrainingLoop:
        """The training loop these options describe, with the optimizer's state as measured for the model and the
        autocast dtype the step runs under (the option's, or the caller's own)."""
        return TrainingLoop(keep_output=self.keep_output, gradient_accumulation_steps=self.gradient_accumulation_steps,
                            batches_held=self.batches_held, zero_grad=self.zero_grad, set_to_none=self.set_to_none,
                            optimizer=optimizer,
                            autocast=str(autocast).removeprefix("torch.") if autocast is not None else None)

    @property
    def sharded(self) -> bool:
        """Whether the plan is for the ranks of an FSDP job (``parallel="fsdp"``, the default past one rank)."""
        return self.parallel == "fsdp" or (self.parallel is None and self.world_size > 1)


def parse_pipeline(text: str) -> Pipeline:
    """``"SCHEDULE:STAGES:MICROBATCHES[:CHUNKS]"`` as a ``Pipeline``.

    Raises:
        OptionError: naming the form and the schedules."""
    parts = text.split(":")
    schedules = ", ".join(s.value for s in Schedule)
    try:
        schedule = Schedule(parts[0].lower())
        numbers = [int(part) for part in parts[1:]]
        if len(numbers) not in (2, 3):
            raise ValueError("two or three numbers")
        return Pipeline(schedule=schedule, stages=numbers[0], microbatches=numbers[1],
                        chunks=numbers[2] if len(numbers) == 3 else 1)
    except ValueError as exc:
        raise OptionError(f"pipeline {text!r}: {exc}; give SCHEDULE:STAGES:MICROBATCHES[:CHUNKS], such as '1f1b:4:8' "
                          f"(schedules: {schedules}; chunks per rank for interleaved_1f1b)") from None


def _host_bytes(value: Any) -> int:
    """``host_budget=`` in bytes: an integer, or a size such as ``"64GB"`` (``planner.common.budget``)."""
    from planner.common.budget import parse_budget

    try:
        nbytes = parse_budget(value)
    except ValueError as exc:
        raise OptionError(f"host_budget must be bytes or a size such as '64GB' (pinned host memory per rank): {exc}"
                          ) from None
    return nbytes


def _check_count(name: str, value: Any, meaning: str) -> None:
    """Raises OptionError unless ``value`` is an integer >= 1 (a bool is not), naming the option and ``meaning``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise OptionError(f"{name} must be an integer >= 1 ({meaning}), got {value!r}")


class OptionArgs(TypedDict, total=False):
    """The fields of ``PlanOptions`` as keyword arguments (``**options: Unpack[OptionArgs]``)."""

    loss_fn: LossFn | None
    keep_output: bool
    solver: str
    time_limit_s: float
    max_chunks: int | None
    selective: bool
    must_save: Sequence[str]
    must_recompute: Sequence[str]
    profile: Profile | None
    device: Any
    world_size: int
    parallel: str | None
    tensor_parallel: int
    units: Sequence[str] | None
    optimizer: Any
    gradient_accumulation_steps: int
    batches_held: int
    zero_grad: ZeroGrad | str
    set_to_none: bool
    autocast: Any
    mixed_precision: Any
    follow_batch: bool | None
    shapes: Sequence[Any] | None
    offload: bool | str | None
    host_budget: int | str | None
    ranks_per_host: int | None
    budget_bounds: BudgetBounds | str
    compilable: bool
    pipeline: Any
    pipeline_rank: int
    compile_backend: str | None
    progress: Callable[[str], None] | None


NAMES = tuple(f.name for f in fields(PlanOptions))
"""Every option, in declaration order."""
PREPARED = tuple(f.name for f in fields(PlanOptions) if f.metadata["prepared"])
"""Options fixed when a model is prepared (captured and profiled); the others shape each solve."""
if set(OptionArgs.__annotations__) != set(NAMES):  # the keyword form is written out for type checkers
    raise AssertionError(f"OptionArgs and PlanOptions differ: {sorted(set(OptionArgs.__annotations__) ^ set(NAMES))}")


AUTOCAST_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
                   "half": "float16"}
"""What ``autocast=`` takes by name: the dtypes ``torch.autocast`` runs in."""


def autocast_dtype(value: Any) -> Any:
    """The torch dtype ``autocast=`` names (``"bf16"``, ``torch.bfloat16``...).

    Raises:
        OptionError: anything else, naming the accepted forms.
    """
    import torch

    if isinstance(value, str) and value.lower() in AUTOCAST_DTYPES:
        return getattr(torch, AUTOCAST_DTYPES[value.lower()])
    if value in (torch.bfloat16, torch.float16):
        return value
    raise OptionError(f"autocast must be one of {', '.join(AUTOCAST_DTYPES)} or torch.bfloat16/torch.float16 (the "
                      f"dtype torch.autocast trains in), got {value!r}")


def resolve(options: PlanOptions | None, overrides: Mapping[str, Any], *, where: str) -> PlanOptions:
    """``options`` (default ``PlanOptions()``) with the keyword arguments ``overrides`` applied.

    Raises:
        OptionError (a ValueError): ``options`` is not a ``PlanOptions``, an override is not an option, or an
            option that does not apply to ``where`` (the entry point) is set; the message names both.
    """
    if options is not None and not isinstance(options, PlanOptions):
        raise OptionError(f"{where}(options=...) takes a planner.PlanOptions, not {type(options).__name__}")
    unknown = sorted(set(overrides) - set(NAMES))
    if unknown:
        raise OptionError(f"{where}() got an unknown option {unknown[0]!r}; the options are: {', '.join(NAMES)}")
    resolved = replace(options or PlanOptions(), **overrides)
    named = {option.name: option for option in fields(PlanOptions)}
    for name in dict.fromkeys([*overrides, *NAMES]):  # the options given by name first (shapes= sets follow_batch)
        why = named[name].metadata["refused"].get(where)
        value = getattr(resolved, name)
        if why is not None and value != named[name].default and value not in named[name].metadata["neutral"]:
            raise OptionError(f"{where}() does not take {name}=: {why}")
    if resolved.pipeline is None and resolved.pipeline_rank != 0:
        raise OptionError(f"pipeline_rank={resolved.pipeline_rank!r} places a stage in a pipeline: give pipeline= too "
                          "(e.g. pipeline='1f1b:4:8')")
    return resolved
