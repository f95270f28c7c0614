"""A profile at another batch shape, from the example's: memory from a meta replay at that shape (exact,
nothing allocated) with what ops allocate inside themselves scaled from the example's measured bytes, times the
example's measured ones scaled node by node by the ratio of roofline estimates at the two shapes. Plans that
follow the batch (``planner.follow``) profile each new shape group this way."""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

from planner.capture.api import Captured
from planner.capture.inputs import Inputs
from planner.capture.step import LossFn
from planner.profiling.devices import load_device
from planner.profiling.estimate import Roofline
from planner.profiling.memory_pass import StepTimes, assemble
from planner.profiling.meta import memory_on_meta
from planner.profiling.record import Profile
from planner.profiling.recorder import Hidden, MemoryRecorder

NodeRoofline = Mapping[str, tuple[float, float]]
"""Per node name: its roofline forward and backward ms at one shape."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Reference:
    """The example's measured profile and its nodes' roofline times, which other shapes' profiles scale from."""

    profile: Profile
    roofline: NodeRoofline


def roofline_of(device: str) -> Roofline:
    """The roofline whose ratios scale times on ``device``: a GPU's spec for CUDA, the generic CPU's else."""
    return Roofline(load_device("h100" if device.startswith("cuda") else "generic-cpu"))


def reference_roofline(captured: Captured, model: nn.Module, example: Inputs, profile: Profile, *,
                       loss_fn: LossFn | None, keep_output: bool) -> dict[str, tuple[float, float]]:
    """The roofline times of the example batch's nodes, to scale its measured times from (run in the setting the
    example was profiled in: ``planner.capture.setting.as_trained``)."""
    replay = memory_on_meta(captured, model, example, loss_fn=loss_fn, keep_output=keep_output,
                            op_ms=roofline_of(profile.device).op_ms, eager=False)
    recorder = replay.recorder
    return {profile.nodes[i].name: (recorder.est_fwd_ms[i], recorder.est_bwd_ms[i]) for i in range(len(profile.nodes))}


def scaled_profile(captured: Captured, model: nn.Module, example: Inputs, scaled_from: Reference, *,
                   loss_fn: LossFn | None, keep_output: bool) -> Profile:
    """The profile at ``example``'s shape (the module docstring). A node the reference does not have (another
    code path at this shape) takes its roofline time times the median measured-to-roofline ratio of the
    reference's nodes."""
    reference, roofline = scaled_from.profile, scaled_from.roofline
    replay = memory_on_meta(captured, model, example, loss_fn=loss_fn, keep_output=keep_output,
                            op_ms=roofline_of(reference.device).op_ms)  # with the model's own forward's locals
    recorder = replay.recorder
    measured = {node.name: (node.fwd_ms, node.bwd_ms) for node in reference.nodes}
    ratios = [measured[name][0] / est[0] for name, est in roofline.items() if name in measured and est[0] > 0]
    usual = statistics.median(ratios) if ratios else 1.0
    fwd: list[float] = []
    bwd: list[float] = []
    for i, record in enumerate(recorder.records):
        now = (recorder.est_fwd_ms[i], recorder.est_bwd_ms[i])
        then, times = roofline.get(record["name"]), measured.get(record["name"])
        for k, out in ((0, fwd), (1, bwd)):
            if then is not None and times is not None and then[k] > 0:
                out.append(times[k] * now[k] / then[k])
            else:
                out.append(now[k] * usual)
    scale = (sum(fwd) + sum(bwd)) / max(1e-9, sum(n.fwd_ms + n.bwd_ms for n in reference.nodes))
    times_ms = StepTimes(fwd_ms=fwd, bwd_ms=bwd, step_fwd_ms=reference.step_fwd_ms * scale,
                         step_bwd_ms=reference.step_bwd_ms * scale,
                         checkpoint_overhead_ms=reference.checkpoint_overhead_ms, sac_op_us=reference.sac_op_us)
    return assemble(recorder, captured, model, replay.example, times=times_ms, excess=replay.excess,
                    device=reference.device, hidden=recorder.with_hidden(_hidden_scaled(recorder, reference)),
                    host_link=_link_of(reference), estimated_for=reference.estimated_for,
                    device_kind="cpu" if reference.rng_state_bytes else "gpu")  # only a CPU's checkpoints stash it


def _link_of(reference: Profile) -> tuple[float, float] | None:
    """The host link the reference measured (a shape group's profile does not measure it again: that copies
    tens of MiB, during the training call the group is planned in)."""
    if reference.d2h_gb_per_s is None or reference.h2d_gb_per_s is None:
        return None
    return reference.d2h_gb_per_s, reference.h2d_gb_per_s


def _hidden_scaled(recorder: MemoryRecorder, reference: Profile) -> Hidden:
    """What each node's ops allocate inside themselves at this shape, which a meta replay cannot see: the
    reference's measured bytes (``NodeCost.fwd_hidden_bytes``...), scaled up by how much more the node allocates
    here than there where it allocates more (workspaces grow with the tensors: a convolution's reorders are its
    output's size), kept where it allocates less (a fixed per-thread buffer does not shrink with the batch)."""
    then = {node.name: node for node in reference.nodes}
    n = len(recorder.records)
    forward, backward, start = [0] * n, [0] * n, [0] * n
    for i, record in enumerate(recorder.records):
        node = then.get(record["name"])
        if node is None:
            continue
        rise = record["fwd_peak"] - record["fwd_start"]
        grown = max(1.0, rise / (node.fwd_peak_bytes - node.fwd_start_bytes)) \
            if node.fwd_peak_bytes > node.fwd_start_bytes else 1.0
        forward[i] = round(node.fwd_hidden_bytes * grown)
        backward[i] = round(node.bwd_hidden_bytes * grown)
        start[i] = node.bwd_start_hidden_bytes
    return Hidden(forward=forward, backward=backward, backward_start=start, peak_bytes=0)
