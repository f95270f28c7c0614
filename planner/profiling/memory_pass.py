"""Runs one real training step node by node and records what each node costs.

For every graph node: the storages it allocates, the ones autograd saves for its
backward (counted per storage, parameters excluded), in-place mutations, the peak
live bytes during its forward and backward, and its forward/backward time. The
result is a plain ``Profile``; nothing of the user's model is changed (buffers,
gradients, RNG state and train/eval mode are restored afterwards).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from planner.capture.api import Captured
from planner.capture.inputs import Inputs
from planner.capture.step import LossFn, default_loss, untouched
from planner.compat.torch_private import tree_leaves
from planner.errors import ProfileError
from planner.profiling.devices import load_device
from planner.profiling.eager import eager_excess, eager_forward_trace
from planner.profiling.link import measure_host_link
from planner.profiling.memtrack import local_of
from planner.profiling.record import LOSS_NODE, NodeCost, Profile
from planner.profiling.recorder import Hidden, MemoryRecorder
from planner.profiling.timing import QUIET, Steps, checkpoint_overhead_ms, measure_sac_op_us, time_step
from planner.profiling.windows import AllocatorWindows


@dataclass(frozen=True, kw_only=True, slots=True)
class StepTimes:
    """Per-node and whole-step times of one step, measured or estimated (ms)."""

    fwd_ms: list[float]
    bwd_ms: list[float]
    step_fwd_ms: float
    step_bwd_ms: float
    checkpoint_overhead_ms: float
    sac_op_us: float | None = None
    """Per-op cost of SAC's dispatch modes, us; None when not measured (estimates)."""


def profile(
    captured: Captured,
    model: nn.Module,
    inputs: Inputs,
    *,
    loss_fn: LossFn | None = None,
    steps: Steps = QUIET,
    keep_output: bool = True,
    limit_bytes: int | None = None,
) -> Profile:
    """Profiles one training step of ``captured`` (a trace of ``model``) where the model is.

    Args:
        captured: the traced model.
        model: the model itself (its buffers, gradients and RNG state are restored).
        inputs: example inputs.
        loss_fn: ``output -> scalar``; default ``default_loss``.
        steps: how many timed steps each time is the fastest of (``timing.Steps``).
        keep_output: the output stays referenced through backward (False: dropped before it).
        limit_bytes: the most bytes the step may allocate beyond what is live when it starts; past it
            ``OverLimit`` is raised at once (the caller profiles in pieces instead).

    Returns:
        The step's ``Profile``.

    Raises:
        ProfileError: a node failed (naming it, the user's line and the input shapes),
            or the model has nothing to differentiate. OverLimit: the step went over ``limit_bytes``.
    """
    loss_fn = loss_fn or default_loss
    device = device_of(model, inputs)
    check_trainable(model)
    with untouched(model):
        recorder = MemoryRecorder(captured.graph_module, model, device, keep_output=keep_output)
        if limit_bytes is not None:
            recorder.tracker.limit_bytes = recorder.tracker.live_bytes + limit_bytes
        recorder.step(inputs, loss_fn)
        recorder.tracker.limit_bytes = None
        excess = eager_excess_of(recorder, captured, model, inputs)
        plain = AllocatorWindows(device)  # read in the first timed step, which has no dispatch mode
        with untouched(model):  # from no gradients again, as the recorded step ran
            timer, step_fwd, step_bwd = time_step(captured.graph_module, inputs, loss_fn, device, steps, plain,
                                                      keep_output=keep_output)
        hidden = recorder.hidden(plain)
        ops = sum(rec["ops"][1] - rec["ops"][0] for rec in recorder.records if rec["kind"] != LOSS_NODE)
        times = StepTimes(fwd_ms=[timer.fwd_ms(i) for i in range(len(recorder.records))],
                          bwd_ms=[timer.bwd_ms(i) for i in range(len(recorder.records))],
                          step_fwd_ms=step_fwd, step_bwd_ms=step_bwd,
                          checkpoint_overhead_ms=checkpoint_overhead_ms(device),
                          sac_op_us=measure_sac_op_us(captured.graph_module, inputs, loss_fn, device, ops,
                                                      step_ms=step_fwd + step_bwd))
    return assemble(recorder, captured, model, inputs, times=times, excess=excess, device=str(device),
                    profile_peak_bytes=hidden.peak_bytes, hidden=hidden)


def check_trainable(model: nn.Module) -> None:
    """Raises ProfileError when no parameter of ``model`` requires grad."""
    if not any(p.requires_grad for p in model.parameters()):
        raise ProfileError(
            f"{type(model).__name__} has no parameter that requires grad: there is no training step "
            "to plan; call requires_grad_() on the parameters you train"
        )


def eager_excess_of(recorder: MemoryRecorder, captured: Captured, model: nn.Module,
                    inputs: Inputs) -> list[int] | None:
    """Per node, what the model's own forward keeps alive beyond the traced graph: the planned module
    calls the user's modules (outside segments for fx plans, everywhere for plans run by module hooks).
    Only where ``CaptureMethod.eager_locals`` says so."""
    if not captured.method.eager_locals:
        return None
    return eager_excess(recorder.forward_trace(), eager_forward_trace(model, inputs, recorder.device),
                        [rec["ops"] for rec in recorder.records])


def assemble(recorder: MemoryRecorder, captured: Captured, model: nn.Module, inputs: Inputs, *,
             times: StepTimes, excess: list[int] | None, device: str, estimated_for: str = "", pieces: int = 1,
             profile_peak_bytes: int | None = None, host_link: tuple[float, float] | None = None,
             hidden: Hidden | None = None, device_kind: str | None = None) -> Profile:
    """The ``Profile`` of a recorded step with its times (measured or estimated); ``host_link``: the GB/s of copies
    to and from pinned host memory (default: measured on the device now, ``planner.profiling.link``; an estimate
    passes its spec's); ``hidden``: what its nodes allocated where the dispatcher does not look, with the step's
    peak at the allocator (``MemoryRecorder.hidden``, ``with_hidden``; default: read from the recorded step);
    ``device_kind``: an estimate's spec kind (``gpu``, ``cpu``; default: the device's type, or the bundled spec
    named ``estimated_for``'s kind)."""
    if host_link is None and not estimated_for:
        host_link = measure_host_link(torch.device(device))
    hidden = hidden or recorder.hidden()
    nodes = tuple(
        NodeCost(
            name=rec["name"], kind=rec["kind"], target=rec["target"], scope=rec["scope"],
            module_path=captured.calls.module_path(i) if i < len(captured.calls.around) else "",
            fwd_ms=times.fwd_ms[i], bwd_ms=times.bwd_ms[i],
            fwd_start_bytes=rec["fwd_start"], fwd_peak_bytes=rec["fwd_peak"],
            bwd_start_bytes=recorder.bwd_start.get(i), bwd_peak_bytes=recorder.bwd_peak.get(i),
            fwd_hidden_bytes=hidden.forward[i], bwd_hidden_bytes=hidden.backward[i],
            bwd_start_hidden_bytes=hidden.backward_start[i], bwd_expanded_grad_bytes=recorder.expanded.get(i, 0),
            bwd_grad_bytes=recorder.bwd_grads.get(i) if i in recorder.bwd_peak else None,
            inputs=tuple(sorted(rec["inputs"])), outputs=tuple(sorted(rec["outputs"])),
            saves=tuple(sorted(rec["saves"])), mutates=tuple(sorted(rec["mutates"])),
            mutated_buffers=tuple(rec["buffers"]), checkpointable=rec["kind"] != LOSS_NODE,
            mutated_buffer_bytes=sum(recorder.buffer_bytes[name] for name in rec["buffers"]),
            eager_excess_bytes=excess[i] if excess else 0, stop_peak_bytes=rec.get("stop_peak"),
            aten_ops=rec["ops"][1] - rec["ops"][0], kernels=tuple(rec["kernels"]), random=rec["random"],
        )
        for i, rec in enumerate(recorder.records)
    )
    return Profile(
        nodes=nodes,
        storages=tuple(replace(st, autocast_cached=True) if i in recorder._cached else st
                       for i, st in enumerate(recorder.storages)),
        device=device,
        torch_version=torch.__version__,
        input_shapes=inputs.describe(),
        param_bytes=recorder.param_bytes,
        grad_bytes=sum(local_of(p).numel() * p.element_size() for p in model.parameters() if p.requires_grad),
        step_fwd_ms=times.step_fwd_ms,
        step_bwd_ms=times.step_bwd_ms,
        checkpoint_overhead_ms=times.checkpoint_overhead_ms, sac_op_us=times.sac_op_us,
        baseline_peak_bytes=hidden.peak_bytes,
        rng_state_bytes=rng_state_bytes(device_kind or (load_device(estimated_for).kind if estimated_for
                                                        else torch.device(device).type)),
        end_bytes=recorder.end_bytes,
        input_bytes=recorder.input_bytes,
        keep_output=recorder.keep_output,
        fingerprint=captured.fingerprint,
        capture_method=captured.method,
        estimated_for=estimated_for,
        pieces=pieces,
        profile_peak_bytes=profile_peak_bytes,
        d2h_gb_per_s=host_link[0] if host_link else None, h2d_gb_per_s=host_link[1] if host_link else None,
    )


def rng_state_bytes(device_kind: str) -> int:
    """Bytes of RNG state on a device of ``device_kind`` (``cpu``, ``cuda``, a spec's ``gpu``) that a checkpoint
    with ``preserve_rng_state`` stashes: the CPU generator's state on a CPU; none on a GPU, whose state torch reads
    into host memory (as it does the CPU's)."""
    return torch.get_rng_state().nbytes if device_kind == "cpu" else 0


def device_of(model: nn.Module, inputs: Inputs) -> torch.device:
    devices = {p.device for p in model.parameters()} | {b.device for b in model.buffers()}
    if len(devices) > 1:
        raise ProfileError(f"the model's parameters are on several devices {sorted(map(str, devices))}; "
                           "ckplan plans for one device: move the model with .to(device)")
    device = devices.pop() if devices else torch.device("cpu")
    for value in tree_leaves((inputs.args, inputs.kwargs)):
        if isinstance(value, torch.Tensor) and value.device != device:
            raise ProfileError(f"an input is on {value.device} but the model's parameters are on {device}; "
                               f"move the inputs with .to('{device}')")
    return device
