"""The result handed to the user: what is checkpointed, what it costs, and the module that runs it.

A ``Plan`` is plain data plus ``module``; it saves to JSON (read back by ``planner.plan_file.load_plan``) and
re-applies to a fresh instance of the same architecture (checked by graph fingerprint).
"""

from __future__ import annotations

import enum
import html
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from torch import nn
from typing_extensions import Unpack

from planner.capture.method import CaptureMethod
from planner.common.budget import format_bytes
from planner.compiled.backend import Graphs, input_embedding
from planner.memory.breakdown import PeakBreakdown
from planner.memory.caching import ReservedPeak
from planner.memory.pipeline import StagePeak
from planner.options import OptionArgs, PlanOptions, resolve
from planner.profiling.devices import SacCostSource
from planner.profiling.headroom import ALLOC_CONF, reserve_note
from planner.rewrite.executor import executor_for
from planner.rewrite.modules import PlannedShapes, break_graph_after
from planner.rewrite.offload import install_offloads
from planner.rewrite.offload_spec import OffloadSpec
from planner.rewrite.segment import Segment
from planner.solve.result import SolverStatus

__all__ = ["CompiledStep", "MemoryTimeline", "Plan", "Segment"]

FORMAT = "ckplan-plan"
VERSION = 2
"""Plan files this ckplan reads and writes: 2 names a hook plan's kept ops (``Segment.saved_ops``); a version 1
file named kept modules, which this ckplan cannot run: plan again."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CompiledStep:
    """What the plan's training step measured compiled (``compile_backend``): its prediction for that step."""

    backend: str
    """The torch.compile backend (``inductor``)."""
    peak_bytes: int
    """The planned step compiled, measured at the allocator, with what the loop keeps besides it (``counted``)."""
    baseline_peak_bytes: int
    """The same for the un-checkpointed model compiled."""
    graphs: Graphs = Graphs.ONE
    """Where the plan breaks dynamo's graph (``Graphs.INPUTS_APART``: a hook after the input embedding, which the
    plan's module carries)."""

    @property
    def how(self) -> str:
        """The backend, and the graph break where there is one."""
        return self.backend + (", the input embedding compiled apart" if self.graphs is Graphs.INPUTS_APART else "")

    def text(self) -> str:
        return (f"compiled step ({self.how}) measured {format_bytes(self.baseline_peak_bytes)} -> "
                f"{format_bytes(self.peak_bytes)}")


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryTimeline:
    """Predicted live bytes during each node's forward and backward, with and without the plan."""

    nodes: tuple[str, ...]
    """Node names in forward order (the loss last); backward runs them in reverse."""
    forward_bytes: tuple[int, ...]
    """Predicted peak bytes during each node's forward, under the plan."""
    backward_bytes: tuple[int | None, ...]
    """Predicted peak bytes during each node's backward, under the plan; None for nodes that run
    nothing in backward."""
    baseline_forward_bytes: tuple[int, ...]
    """As ``forward_bytes``, without checkpointing."""
    baseline_backward_bytes: tuple[int | None, ...]
    """As ``backward_bytes``, without checkpointing."""
    offloaded_forward_bytes: tuple[int, ...] = ()
    """Bytes the plan's offloads keep off the device (in host memory) during each node's forward: without them it
    would hold ``forward_bytes`` plus these. Empty when it offloads nothing."""
    offloaded_backward_bytes: tuple[int | None, ...] = ()
    """As ``offloaded_forward_bytes``, during each node's backward (None where ``backward_bytes`` is)."""


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A checkpointing plan for one model, budget and input shape.

    Attributes:
        module: the planned module (shares parameters and buffers with the model);
            None for a plan loaded from JSON until ``apply`` is called.
    """

    module: nn.Module | None = field(repr=False, compare=False)
    budget_bytes: int
    predicted_peak_bytes: int
    """Peak of one training step under the plan, from the memory model."""
    baseline_peak_bytes: int
    """Predicted peak without checkpointing, of the step plans run: a Hugging Face model's key/value cache off
    (``use_cache=False`` in training calls, ``planner/capture/cache.py``), which its own call may keep on
    (GPT-2: two copies of k and v per layer more, ``docs/huggingface.md``)."""
    predicted_overhead: float
    """Recompute time / un-checkpointed step time (0.0 for the empty plan)."""
    recompute_ms: float
    step_ms: float
    """Measured time of one un-checkpointed step, ms."""
    segments: tuple[Segment, ...]
    solver_status: SolverStatus
    """``OPTIMAL`` (proven under the cost model, among the cut positions of ``chunks``), ``FEASIBLE`` (time limit or
    Ctrl-C hit) or ``FIXED`` (a baseline)."""
    solve_time_s: float
    """Seconds the solve stage took: every strategy and finer chunking tried (what ``time_limit_s`` bounds)."""
    recompute_bound_ms: float | None = None
    """Proven lower bound on the recompute time of any plan that fits the budget and cuts where ``chunks`` allows
    (``recompute_ms`` itself when OPTIMAL); None when nothing is proven, e.g. a fixed baseline's plan."""
    chunks: int | None = None
    """How many chunks the plan was solved over when the graph has more cut positions than that (the time limit
    or ``max_chunks`` stopped finer chunkings: ``docs/solver.md``); None when the solve chose among every cut
    position. A finer chunking may hold plans that re-run less than ``recompute_bound_ms``."""
    fingerprint: str
    """Structure hash of the traced graph the plan refers to."""
    capture_method: CaptureMethod
    """Which capture tier produced that graph (``.label`` is the sentence reports show)."""
    capture_notes: tuple[str, ...] = ()
    """Why earlier capture methods failed, one line each."""
    device: str
    source: str = field(default="", repr=False)
    """Python source of the planned module's generated class."""
    peak_breakdown: PeakBreakdown | None = field(default=None, repr=False)
    """What the predicted peak is made of (``.items()`` gives the labelled components)."""
    largest_kept: tuple[tuple[str, int, str], ...] = field(default=(), repr=False)
    """Largest activations alive at the predicted peak: (producing node, bytes, why it stays)."""
    timeline: MemoryTimeline | None = field(default=None, repr=False)
    """Predicted memory over one step, for plots."""
    sac_op_us: float | None = None
    """Per-op cost of selective checkpointing the plan was made with, microseconds (None: not known)."""
    sac_cost_source: SacCostSource | None = None
    """Where ``sac_op_us`` comes from: measured on the model, the device spec, or ckplan's default."""
    keep_output: bool = True
    """Whether the predicted peak assumes the loop keeps the model's output referenced through
    backward (``optimize(keep_output=...)``)."""
    counted: tuple[str, ...] = ()
    """What the predicted peak counts of the training loop besides the step's own tensors, one phrase each
    (``planner.common.loop.TrainingLoop.counted``: the optimizer's state, gradients alive, autocast, the output)."""
    family: Any = field(default=None, repr=False, compare=False)
    """When the plan follows the batch (``follow_batch``): the ``planner.follow.family.Family`` of its groups' plans;
    ``segments`` are the example batch's group's. None: one plan for every call."""
    profile_pieces: int = 1
    """How many pieces the profiled step ran in (1: whole; more when it did not fit where it was profiled)."""
    profile_peak_bytes: int | None = None
    """Peak bytes profiling held on the device (``Profile.profile_peak_bytes``); None for an estimate."""
    offload: OffloadSpec | None = field(default=None, repr=False)
    """The activations the plan copies to host memory and back, and what the model predicts of the copies
    (``docs/offload.md``); None: it offloads nothing."""
    reserved: ReservedPeak | None = field(default=None, repr=False)
    """On a GPU: what the CUDA caching allocator is predicted to reserve for the step (the predicted peak plus its
    rounding and segments: ``docs/memory-model.md``), which ``budget_bounds="reserved"`` (default) keeps within
    the budget; None on a CPU, and where it is not predicted (a distributed job's rank, a step under autocast)."""
    planned_inputs: dict[str, tuple[int, ...]] = field(default_factory=dict, repr=False)
    """Shape of each tensor argument of the example call, by parameter name: a plan that runs the
    model's own forward warns once when a training call is larger (``planner.rewrite.modules``)."""
    pipeline_stage: StagePeak | None = None
    """For a stage of a pipeline-parallel job (``pipeline``): what the microbatches its schedule keeps in flight
    add, and the stage's peak, which the budget bounds (``predicted_peak_bytes`` is one microbatch's step)."""
    compiled_step: CompiledStep | None = None
    """For a step run under torch.compile (``compile_backend``): the compiled step as measured, which the budget
    bounds (``predicted_peak_bytes`` is the eager step's); None for an eager step."""

    def apply(self, model: nn.Module, *, inputs: Any = None, options: PlanOptions | None = None,
              **overrides: Unpack[OptionArgs]) -> nn.Module:
        """Returns ``model`` set up to run this plan (``model`` itself is not modified), by the executor
        of the plan's capture method (``planner.rewrite.executor``).

        A plan that runs the model's own forward (Hugging Face models and others torch.fx cannot trace)
        needs no inputs: it is a clone of ``model`` with the plan's hooks, and each chain checks on its first
        training forward that the model runs it. A rewritten graph captures ``model`` again and checks it is
        the graph the plan was made for.

        Args:
            model: a fresh instance of the architecture the plan was made for.
            inputs: example inputs for a model fx cannot trace without them (default
                ``model.example_inputs``); unused by plans that run the model's own forward.
            options, **overrides: the ``PlanOptions`` a saved plan still reads: ``units`` (the FSDP units a
                distributed plan was made with; default the repeated blocks) and, for a plan that follows the
                batch, ``loss_fn`` (what its new shape groups are planned with; default ``output.loss`` or the
                sum of the floating outputs). The others are refused: the plan is applied as it was made.

        Raises:
            PlanMismatch (a ValueError): ``model`` does not trace to the graph the plan was made for.
            ChainError: a plan run by hooks names a module ``model`` does not have.
            OptionError: an option the plan was made with.
        """
        opts = resolve(options, overrides, where="Plan.apply")
        family = None if self.family is None else \
            self.family.bound(model, replace(self.family.options, loss_fn=opts.loss_fn))  # new groups planned on model
        module = executor_for(self.capture_method).apply(model, self.segments, fingerprint=self.fingerprint,
                                                         inputs=inputs, units=opts.units,
                                                         planned=self.planned_shapes(), follow=family)
        if family is None:  # a family's switch runs each group's own
            install_offloads(module, self.offload)
        if self.compiled_step is not None and self.compiled_step.graphs is Graphs.INPUTS_APART:
            embedding = input_embedding(module)
            if embedding is not None:
                break_graph_after(module, embedding)
        return module

    def planned_shapes(self) -> PlannedShapes | None:
        """What the shape warning of a plan run by hooks compares calls with; None without shapes."""
        if not self.planned_inputs:
            return None
        fixed = self.peak_breakdown.parameters_bytes if self.peak_breakdown is not None else 0
        return PlannedShapes(shapes={k: tuple(v) for k, v in self.planned_inputs.items()},
                             predicted_peak_bytes=self.predicted_peak_bytes, fixed_bytes=fixed,
                             budget_bytes=self.budget_bytes)

    def summary(self) -> str:
        """A human-readable table of the plan."""
        peak = f"peak {format_bytes(self.baseline_peak_bytes)} -> {format_bytes(self.predicted_peak_bytes)}"
        budget = f"budget {format_bytes(self.budget_bytes)}"
        if self.compiled_step is not None:  # the budget bounds the compiled step; the eager model's peak beside it
            peak, budget = self.compiled_step.text(), f"{budget}; eager model: {peak}"
        if self.pipeline_stage is not None:  # the budget bounds the stage; one microbatch's step beside it
            peak = f"{self.pipeline_stage.text()} (one microbatch's step: {peak})"
        lines = [
            f"ckplan: {len(self.segments)} checkpointed segment(s), solver {self.solver_status} "
            f"in {self.solve_time_s:.2f} s (capture: {self.capture_method.label}, device: {self.device})",
            f"{peak} ({budget}), recompute {self.recompute_ms:.2f} ms per step "
            f"= +{100 * self.predicted_overhead:.1f}% of a {self.step_ms:.2f} ms step",
        ]
        if self.offload is not None:
            lines.append(f"  {offload_text(self.offload)}")
        if self.counted:
            lines.append(f"  counted: {'; '.join(self.counted)}")
        reserve = reserve_text(self)
        if reserve:
            lines.append(f"  reserved: {reserve}")
        lines += [f"  ({note.splitlines()[0][:160]})" for note in self.capture_notes]
        if self.segments:
            width = max(len(_describe(s)) for s in self.segments)
            lines.append(f"  {'#':>3}  {'segment':<{width}}  {'nodes':>5}  {'saved':>5}  {'recompute':>10}")
            for i, seg in enumerate(self.segments):
                lines.append(f"  {i:>3}  {_describe(seg):<{width}}  {len(seg.nodes):>5}  {len(seg.saved_nodes):>5}  "
                             f"{seg.recompute_ms:>7.2f} ms")
        else:
            lines.append(f"  {nothing_checkpointed(self)}")
        if self.family is not None:
            lines.append(f"  follows the batch: {len(self.family.groups)} shape group(s) planned")
            lines += [f"    {'  '.join(cells)}" for cells in group_cells(self)]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready description (everything but the module)."""
        data = {"format": FORMAT, "version": VERSION}
        for name in ("budget_bytes", "predicted_peak_bytes", "baseline_peak_bytes", "predicted_overhead",
                     "recompute_ms", "step_ms", "solver_status", "solve_time_s", "recompute_bound_ms", "chunks",
                     "fingerprint", "capture_method", "capture_notes", "device", "source", "sac_op_us",
                     "sac_cost_source", "planned_inputs", "keep_output", "counted", "profile_pieces",
                     "profile_peak_bytes"):
            value = getattr(self, name)
            data[name] = value.value if isinstance(value, enum.Enum) else value  # enums as their short value
        data["peak_breakdown"] = None if self.peak_breakdown is None else self.peak_breakdown.to_dict()
        data["largest_kept"] = [list(item) for item in self.largest_kept]
        data["timeline"] = None if self.timeline is None else {k: list(v) for k, v in asdict(self.timeline).items()}
        data["segments"] = [asdict(s) for s in self.segments]
        data["family"] = None if self.family is None else self.family.to_dict()
        data["offload"] = None if self.offload is None else asdict(self.offload)
        data["reserved"] = None if self.reserved is None else asdict(self.reserved)
        data["pipeline_stage"] = None if self.pipeline_stage is None else asdict(self.pipeline_stage)
        data["compiled_step"] = None if self.compiled_step is None else \
            {**asdict(self.compiled_step), "graphs": self.compiled_step.graphs.value}
        return data

    def save(self, path: str | Path) -> None:
        """Writes ``to_dict()`` as JSON; read it back with ``load_plan``."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    def _repr_html_(self) -> str:
        """A notebook summary: the plan's numbers (its offloads among them) and its checkpointed segments."""
        numbers = [
            ["predicted peak", f"{format_bytes(self.baseline_peak_bytes)} → {format_bytes(self.predicted_peak_bytes)}"],
            ["budget", format_bytes(self.budget_bytes)],
            ["overhead", f"+{100 * self.predicted_overhead:.1f}% ({self.recompute_ms:.2f} ms per "
                         f"{self.step_ms:.2f} ms step)"],
            ["solver", f"{self.solver_status} in {self.solve_time_s:.2f} s"],
            ["device", self.device],
        ]
        if self.offload is not None:
            numbers.insert(3, ["offload", offload_text(self.offload).removeprefix("offloads ")])
        segments = [[str(i), ", ".join(s.module_paths), str(len(s.nodes)), format_bytes(s.freed_bytes),
                     f"{s.recompute_ms:.2f} ms"] for i, s in enumerate(self.segments)]
        parts = [f"<div><p><b>ckplan plan</b>: {len(self.segments)} checkpointed segment(s)</p>",
                 html_table(["", ""], numbers)]
        if segments:
            parts.append(html_table(["#", "modules", "nodes", "frees", "recompute"], segments))
        else:
            parts.append(f"<p>{nothing_checkpointed(self)}</p>")
        if self.family is not None:
            parts.append(f"<p>follows the batch: {len(self.family.groups)} shape group(s) planned</p>")
            parts.append(html_table(GROUP_COLUMNS, group_cells(self)))
        return "".join(parts) + "</div>"

    def __repr__(self) -> str:
        peak = (format_bytes(self.predicted_peak_bytes) if self.compiled_step is None
                else f"{format_bytes(self.compiled_step.peak_bytes)} compiled")
        return (f"Plan(segments={len(self.segments)}, peak {peak} of budget "
                f"{format_bytes(self.budget_bytes)}, overhead +{100 * self.predicted_overhead:.1f}%, "
                f"{self.solver_status})")


def nothing_checkpointed(plan: Plan) -> str:
    """What a plan without segments says: it fits as it is, or its offloads make it fit."""
    if plan.offload is not None:
        return "nothing checkpointed: the offloads alone bring the step within the budget"
    return "nothing checkpointed: the model already fits the budget"


def reserve_text(plan: Plan) -> str | None:
    """On a GPU, one line on what the CUDA caching allocator reserves for the plan's step and what the budget
    bounds; None on a CPU."""
    reserved = plan.reserved
    if reserved is None:
        return reserve_note(plan.device)
    setting = "with expandable segments" if reserved.expandable else "without expandable segments"
    text = (f"{format_bytes(reserved.needed_bytes)} predicted at the device's limit {setting} "
            f"({format_bytes(reserved.roomy_bytes)} with room to spare: max_memory_reserved)")
    if reserved.needed_bytes > plan.budget_bytes:
        text += (", over the budget, which bounds what it allocates here (budget_bounds='allocated', or a placement "
                 "by hand)")
    if not reserved.expandable and reserved.other_bytes < reserved.needed_bytes:
        text += (f"; {ALLOC_CONF}=expandable_segments:True would need {format_bytes(reserved.other_bytes)}")
    return text


def offload_text(offload: OffloadSpec) -> str:
    """One line on a plan's offloads: how much, how busy the host link is, what the copies cost."""
    return (f"offloads {offload.storages} activation(s), {format_bytes(offload.offloaded_bytes)}, to host memory: "
            f"{offload.link_busy()}; copies add {offload.exposed_ms:.2f} ms")


def _describe(segment: Segment) -> str:
    paths = segment.module_paths
    return ", ".join(paths) if len(paths) <= 3 else f"{paths[0]} ... {paths[-1]} ({len(paths)} parts)"


GROUP_COLUMNS = ("shapes (up to)", "segments", "peak", "recompute")
"""The columns of a plan's shape groups (``group_cells``)."""


def group_cells(plan: Plan) -> list[list[str]]:
    """One row of text per shape group of a plan that follows the batch, smallest first: its upper shapes,
    its checkpointed segments, its un-checkpointed → predicted peak, its recompute share of its step."""
    if plan.family is None:
        return []
    rows = []
    for row in plan.family.table():
        shapes = shapes_text(row["shapes"])
        offloaded = row.get("offloaded_bytes", 0)
        peak = (f"{format_bytes(row['baseline_peak_bytes'])} (fits)" if not row["segments"] and not offloaded else
                f"{format_bytes(row['baseline_peak_bytes'])} → {format_bytes(row['predicted_peak_bytes'])}")
        segments = str(row["segments"]) + (f", {format_bytes(offloaded)} offloaded" if offloaded else "")
        rows.append([shapes, segments, peak, f"+{100 * row['overhead']:.1f}%"])
    return rows


def shapes_text(shapes: Mapping[str, Sequence[int]]) -> str:
    """``4x128`` when every argument has that shape, else ``input_ids 4x128, pixel_values 4x3x32x32``."""
    texts = {name: "x".join(map(str, shape)) for name, shape in shapes.items()}
    if len(set(texts.values())) == 1:
        return next(iter(texts.values()))
    return ", ".join(f"{name} {text}" for name, text in texts.items())


def html_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """An HTML table of escaped text cells (the notebook summaries of plans and trade-offs)."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
