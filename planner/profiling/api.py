"""The profile stage's entry point: the profile a model is planned with (measured here, in pieces when the step
does not fit, or estimated for a device spec), and the check that a saved profile belongs to the model and
inputs it is used with. ``planner.profile`` and ``optimize(..., profile=, device=)`` go through
``profile_for``; saving and loading live in ``record.py``.
"""

from __future__ import annotations

import gc

import torch
from torch import nn

from planner.capture.api import Captured
from planner.capture.inputs import Inputs
from planner.capture.step import LossFn
from planner.errors import InputError, OptionError, ProfileError, ProfileMismatch
from planner.profiling.cores import threads_for_timing
from planner.profiling.devices import DeviceSpec, device_names, is_device_spec, load_device
from planner.profiling.fitting import FIT_SHARE, fitting_profile, resident_bytes
from planner.profiling.headroom import hard_limit, headroom_bytes
from planner.profiling.memory_pass import device_of
from planner.profiling.memory_pass import profile as measure
from planner.profiling.memtrack import OverLimit, dtensor_class
from planner.profiling.meta import estimate, memory_on_meta, to_meta
from planner.profiling.record import LOSS_NODE, Profile
from planner.profiling.scaling import Reference, scaled_profile
from planner.profiling.timing import QUIET, Steps

Device = str | torch.device | None


def profile_for(captured: Captured, model: nn.Module, example: Inputs, *, loss_fn: LossFn | None = None,
                device: Device = None, saved: Profile | None = None, keep_output: bool = True,
                budget: int | str | None = None, scaled_from: Reference | None = None) -> Profile:
    """The profile to plan ``captured`` with: ``saved`` once checked against it, estimated for the device
    spec ``device``, scaled to ``example``'s shape from the profile of another shape (``scaled_from``: a shape
    group of a plan that follows the batch), or measured where the model is (``device`` None): the whole step
    when it fits in what the device has left, else in pieces that fit (``measured``)."""
    if scaled_from is not None:
        return scaled_profile(captured, model, example, scaled_from, loss_fn=loss_fn, keep_output=keep_output)
    if saved is not None:
        if not isinstance(saved, Profile):
            raise InputError(f"profile= takes a planner.Profile (from planner.profile or planner.load_profile), "
                             f"not {type(saved).__name__}")
        if device is not None:
            raise OptionError(f"pass profile= or device=, not both: the profile already says its device "
                              f"({saved.device})")
        check_profile(saved, captured, example)
        if saved.keep_output != keep_output:
            raise OptionError(f"this profile was measured with keep_output={saved.keep_output}; plan with the same "
                              f"(keep_output={saved.keep_output}) or profile again")
        return saved
    spec = resolve_device(model, device)
    if spec is None:
        return measured(captured, model, example, loss_fn=loss_fn, keep_output=keep_output, budget=budget)
    return estimate(captured, model, example, spec=spec, loss_fn=loss_fn, keep_output=keep_output)


def measured(captured: Captured, model: nn.Module, example: Inputs, *, loss_fn: LossFn | None = None,
             keep_output: bool = True, budget: int | str | None = None) -> Profile:
    """The profile measured where the model is (``measured_here``), its steps run with no more intra-op threads
    than the machine has cores free (``planner.profiling.cores``: on a busy CPU, threads waiting for each other
    made the profiled step 2-4x slower than one thread did), twice as many and for longer where it is busy. A
    tensor-parallel model (DTensor parameters) takes the same count on every rank, whatever each rank's load
    (``Steps.lockstep``): its forward runs collectives, which a rank timing one step more would wait on forever."""
    dtensor = dtensor_class()
    lockstep = dtensor is not None and any(isinstance(p, dtensor) for p in model.parameters())
    with threads_for_timing(device_of(model, example)) as timing:
        steps = Steps.lockstep() if lockstep else Steps.for_machine(timing.busy)
        return measured_here(captured, model, example, loss_fn=loss_fn, keep_output=keep_output, budget=budget,
                             steps=steps)


def measured_here(captured: Captured, model: nn.Module, example: Inputs, *, loss_fn: LossFn | None = None,
                  keep_output: bool = True, budget: int | str | None = None, steps: Steps = QUIET) -> Profile:
    """The profile measured where the model is. Where going past what the device has left makes an
    allocation fail (``hard_limit``: a GPU, a capped process), the step's memory is first replayed on meta
    tensors (exact sizes, nothing allocated): when it needs more than ``FIT_SHARE`` of what is left
    (``headroom_bytes``), it is profiled in pieces that fit what is left and, when they can, the ``budget``
    (``fitting.fitting_profile``). Else the whole step runs, guarded: past that share, or out of memory,
    it stops, the allocator's cache is released, and it is profiled in pieces after all."""
    here = device_of(model, example)
    room = headroom_bytes(here)
    if room is not None and hard_limit(here):  # an allocation past it fails: do not try the whole step blind
        try:
            replay = memory_on_meta(captured, model, example, loss_fn=loss_fn, keep_output=keep_output)
        except Exception:  # meta tensors cannot run this code (it reads values): the guarded real step tells
            replay = None
        if replay is not None and replay.recorder.tracker.peak_bytes - resident_bytes(model, example) > \
                room * FIT_SHARE:
            return fitting_profile(captured, model, example, room_bytes=room, budget=budget, loss_fn=loss_fn,
                                   keep_output=keep_output, replay=replay, runs=steps.runs)
    try:
        return measure(captured, model, example, loss_fn=loss_fn, keep_output=keep_output, steps=steps,
                       limit_bytes=None if room is None else int(room * FIT_SHARE))
    except (ProfileError, RuntimeError) as exc:
        if not out_of_memory(exc):
            raise
    gc.collect()
    if here.type == "cuda":
        torch.cuda.empty_cache()
    return fitting_profile(captured, model, example, room_bytes=headroom_bytes(here), budget=budget,
                           loss_fn=loss_fn, keep_output=keep_output, runs=steps.runs)


_OUT_OF_MEMORY = ("can't allocate memory", "out of memory")
"""What the CPU and CUDA allocators say when an allocation fails."""


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) says the device ran out of memory: the profiler's own guard
    (``OverLimit``), CUDA's ``OutOfMemoryError``, or the CPU allocator's "can't allocate memory"."""
    seen: BaseException | None = exc
    while seen is not None:
        said = str(seen) if isinstance(seen, RuntimeError) else ""
        if isinstance(seen, (OverLimit, torch.OutOfMemoryError)) or any(m in said for m in _OUT_OF_MEMORY):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def is_meta_model(model: nn.Module) -> bool:
    return any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))


def capture_inputs(model: nn.Module, example: Inputs) -> Inputs:
    """The inputs to capture with: meta copies for a model on the meta device."""
    if not is_meta_model(model):
        return example
    return Inputs(args=tuple(to_meta(v) for v in example.args),
                  kwargs={k: to_meta(v) for k, v in example.kwargs.items()})


def step_device_type(model: nn.Module, device: Device) -> str:
    """The kind of torch device the training step runs on (``cuda``, ``cpu``): a device spec's, else where the
    model is."""
    spec = resolve_device(model, device)  # an unknown device: its one-line error
    if spec is not None:
        return "cuda" if spec.kind == "gpu" else "cpu"
    first = next(iter(model.parameters()), None)
    return first.device.type if first is not None else "cpu"


def resolve_device(model: nn.Module, device: Device) -> DeviceSpec | None:
    """The device spec to estimate for, or None to measure where the model is.

    Raises:
        OptionError (a ValueError): a meta model without a spec, a torch device the model is not on, or an
            unknown name.
    """
    known = ", ".join(device_names())
    if device is None:
        if is_meta_model(model):
            raise OptionError(f"the model is on the meta device, so it cannot be run here: pass device= with a "
                              f"device spec to estimate for ({known})")
        return None
    if is_device_spec(device):
        return load_device(device)
    try:
        wanted = torch.device(device)
    except (RuntimeError, TypeError):
        return load_device(str(device))  # raises OptionError listing the known specs
    here = next((t.device for t in model.parameters()), torch.device("cpu"))
    if wanted.type != here.type or (wanted.index is not None and wanted != here):
        raise OptionError(f"device={str(device)!r} but the model is on {here}: to measure there, move the model "
                          f"and inputs with .to({str(device)!r}); to estimate for a device that is not here, "
                          f"name its spec ({known})")
    return None


def check_profile(prof: Profile, captured: Captured, example: Inputs) -> None:
    """Raises ProfileMismatch naming every difference between ``prof`` and this model and inputs."""
    differences = []
    if prof.fingerprint != captured.fingerprint:
        how = "" if prof.capture_method == captured.method else \
            f" (captured with {prof.capture_method.label if prof.capture_method else 'an unknown method'}, " \
            f"now with {captured.method.label})"
        differences.append(f"graph fingerprint {prof.fingerprint or '(none)'} vs {captured.fingerprint} of this "
                           f"model{how}: another architecture or configuration")
    else:  # the same graph: an edited file may still name other nodes
        graph = [n.name for n in captured.graph_module.graph.nodes if n.op not in ("placeholder", "output")]
        named = [n.name for n in prof.nodes]
        if named != [*graph, LOSS_NODE]:
            at = next((i for i, (a, b) in enumerate(zip(named, [*graph, LOSS_NODE])) if a != b), None)
            differences.append(f"{len(named)} profiled nodes vs {len(graph) + 1} of this model's graph" if at is None
                               else f"node {at} is {named[at]!r} in the profile but {[*graph, LOSS_NODE][at]!r} in "
                                    "this model's graph (the file was edited)")
    given = example.describe()
    if tuple(prof.input_shapes) != given:
        pairs = [f"{a} vs {b}" for a, b in zip(prof.input_shapes, given) if a != b]
        if len(prof.input_shapes) != len(given):
            pairs.append(f"{len(prof.input_shapes)} inputs vs {len(given)}")
        differences.append("inputs " + "; ".join(pairs))
    if differences:
        raise ProfileMismatch("the profile does not match this model and inputs: " + "; ".join(differences)
                              + "; profile this model again (planner.profile(model, inputs=...))")
