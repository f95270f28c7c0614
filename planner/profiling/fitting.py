"""Profiling a training step that does not fit whole where the model is.

People checkpoint because the plain step does not fit. Then the step is never run whole: its memory
comes from the same memory pass replayed on meta tensors (``meta.memory_on_meta``: sizes are exact, and
nothing is allocated), and its times are measured on the device in contiguous pieces of nodes
(``pieces.time_in_pieces``), each piece small enough that parameters, gradients, the values crossing
into it and its own activations and backward stay under a ceiling: the memory the device has left, and
the budget when one is given. One extra step in pieces measures the profiler's own peak, which is part of the
profile, and what each node's ops allocate inside themselves, which meta tensors cannot show.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.fx as fx
from torch import nn

from planner.capture.api import Captured
from planner.capture.inputs import Inputs
from planner.capture.step import LossFn, default_loss, untouched
from planner.common.budget import is_device_budget, parse_budget
from planner.common.units import format_bytes
from planner.compat.torch_private import storage_id, tree_leaves
from planner.errors import ProfileError
from planner.profiling.allocator import AllocatorTrace
from planner.profiling.memory_pass import StepTimes, assemble, device_of
from planner.profiling.memtrack import LiveStorages
from planner.profiling.meta import MetaReplay, memory_on_meta
from planner.profiling.pieces import Piece, PieceTimer, time_in_pieces
from planner.profiling.record import Profile
from planner.profiling.recorder import Hidden
from planner.profiling.timing import TIMING_RUNS

FIT_SHARE = 0.7
"""Share of the memory a device has left that profiling may take: the rest is for the allocator's rounding
and fragmentation, autograd's own objects and the rest of the process."""


def fitting_profile(captured: Captured, model: nn.Module, inputs: Inputs, *, room_bytes: int | None,
                    budget: int | str | None = None, loss_fn: LossFn | None = None, keep_output: bool = True,
                    runs: int = TIMING_RUNS, replay: MetaReplay | None = None) -> Profile:
    """The profile of one training step of ``captured`` that does not fit whole where the model is: memory
    from a meta-tensor replay, times measured in pieces (``choose_pieces``) that hold at most what the device
    has left (``room_bytes`` beyond the parameters and inputs, ``FIT_SHARE`` of it) and, when a ``budget`` is
    given and pieces fit in it, at most the budget.

    Raises:
        ProfileError: a node failed, or a single node needs more than the device has left (named, with sizes).
    """
    loss_fn = loss_fn or default_loss
    device = device_of(model, inputs)
    if replay is None:
        replay = memory_on_meta(captured, model, inputs, loss_fn=loss_fn, keep_output=keep_output)
    shape = assemble(replay.recorder, captured, model, replay.example, times=_no_times(len(replay.recorder.records)),
                     excess=replay.excess, device=str(device))
    device_ceiling = None if room_bytes is None else resident_bytes(model, inputs) + int(room_bytes * FIT_SHARE)
    budget_bytes = None if budget is None or is_device_budget(budget) else \
        parse_budget(budget, baseline_peak_bytes=shape.baseline_peak_bytes)  # the device's room bounds the pieces
    ceilings = [c for c in (budget_bytes, device_ceiling) if c is not None]
    if not ceilings:
        raise ProfileError(f"the training step ran out of memory on {device}, and how much memory {device} has "
                           "left cannot be told: plan with a budget (optimize(model, budget, ...))")
    pieces = _pieces_within(shape, sorted(ceilings))
    times = time_in_pieces(captured, model, inputs, pieces=pieces, loss_fn=loss_fn, device=device, runs=runs)
    memory = pieces_memory(captured, model, inputs, pieces=pieces, loss_fn=loss_fn, device=device)
    return assemble(replay.recorder, captured, model, replay.example, times=times, excess=replay.excess,
                    device=str(device), pieces=len(pieces), profile_peak_bytes=memory.peak_bytes,
                    hidden=replay.recorder.with_hidden(memory.hidden))


class PieceSizes:
    """Upper estimates of what one piece of a profiled step holds (``bytes``), from the profile's memory."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        n = len(profile.nodes)
        last = [st.producer for st in profile.storages]
        for i, node in enumerate(profile.nodes):
            for s in node.inputs:
                last[s] = max(last[s], i)
        change = np.zeros(n + 2, dtype=np.int64)  # crossing[b]: bytes made before node b and read at or after
        for s, st in enumerate(profile.storages):
            if last[s] > st.producer:
                change[st.producer + 1] += st.nbytes
                change[last[s] + 1] -= st.nbytes
        self.crossing = np.cumsum(change)[: n + 1]
        self.start = np.array([nd.fwd_start_bytes for nd in profile.nodes], dtype=np.int64)
        self.peak = np.array([nd.fwd_allocator_peak_bytes for nd in profile.nodes], dtype=np.int64)
        self.bwd_rise = np.array([(nd.bwd_allocator_peak_bytes or 0) - (nd.bwd_start_bytes or 0)
                                  for nd in profile.nodes], dtype=np.int64)
        self.fixed = profile.param_bytes + profile.grad_bytes

    def bytes(self, lo: int, hi: int) -> int:
        """Nodes ``[lo, hi)`` run as one piece, forward and backward: parameters, buffers and every gradient,
        the values crossing into the piece (and on to later pieces), what the piece adds in its forward (its
        largest rise in the whole step's live bytes), and in its backward what it kept, the gradients of
        its outputs and of its inputs (the values crossing in), and its largest transient."""
        start = int(self.start[lo])
        forward = int(self.peak[lo:hi].max()) - start
        end = int(self.start[hi]) if hi < len(self.start) else start
        backward = max(0, end - start) + int(self.crossing[min(hi, len(self.crossing) - 1)]) \
            + int(self.crossing[lo]) + int(self.bwd_rise[lo:hi].max())
        return self.fixed + int(self.crossing[lo]) + max(forward, backward)


def choose_pieces(profile: Profile, ceiling_bytes: int) -> list[Piece]:
    """Contiguous pieces covering every node of ``profile`` (the loss in the last), each as long as
    ``PieceSizes.bytes`` stays within ``ceiling_bytes``.

    Raises:
        ProfileError: one node alone needs more than ``ceiling_bytes``; the message names it and the sizes.
    """
    sizes, n = PieceSizes(profile), len(profile.nodes)
    pieces: list[Piece] = []
    lo = 0
    while lo < n:
        need = sizes.bytes(lo, lo + 1)
        if need > ceiling_bytes:
            node = profile.nodes[lo]
            raise ProfileError(
                f"node {node.name} ({node.target}) alone needs about {format_bytes(need)} to be profiled "
                f"(parameters and gradients {format_bytes(sizes.fixed)}), more than the "
                f"{format_bytes(ceiling_bytes)} this process can use on {profile.device}: free memory on the "
                "device, or plan from a profile saved elsewhere (profile=) or for a device spec (device=)")
        hi = lo + 1
        while hi < n and sizes.bytes(lo, hi + 1) <= ceiling_bytes:
            hi += 1
        pieces.append((lo, hi))
        lo = hi
    return pieces


@dataclass(frozen=True, kw_only=True, slots=True)
class PiecesMemory:
    """What one step run in pieces showed of memory."""

    peak_bytes: int
    """The step's peak at the device's allocator (as ``planner.profiling.measure`` reads it)."""
    hidden: Hidden
    """Per node, what its ops allocated inside themselves beyond the live storages' rise (the meta replay the
    profile's memory comes from cannot see it)."""


class _Windows(PieceTimer):
    """A step in pieces whose every node's forward and backward is a window of a ``LiveStorages`` and of an
    ``AllocatorTrace``: the allocator's rise in a window beyond the live storages' rise is what the node's ops
    allocated inside themselves."""

    def __init__(self, gm: fx.GraphModule, device: torch.device, pieces: list[Piece]) -> None:
        super().__init__(gm, device, pieces)
        self.tracker = LiveStorages(device)
        self.allocator = AllocatorTrace(device)
        self._opened: list[tuple[bool, int, int]] = []  # (backward, node, live bytes when opened)
        self._rises: list[int] = []  # of the live storages, per window closed

    def _mark(self, backward: bool, index: int) -> None:
        if self._opened:
            self._rises.append(self.tracker.window_peak_bytes - self._opened[-1][2])
        self._opened.append((backward, index, self.tracker.mark()))
        self.allocator.mark()

    def around_node(self, index, node, compute, values):
        self._mark(False, index)
        return super().around_node(index, node, compute, values)

    def on_backward(self, index, phase):
        if phase == "pre":
            self._mark(True, index)
        super().on_backward(index, phase)

    def hidden(self) -> Hidden:
        """Per node, what the allocator held beyond the live storages at the peak of each of its windows, as it
        would in the whole step: the most its ops allocated inside themselves beyond the live storages' rise,
        plus what earlier nodes left allocated outside storages and autograd still holds (scalars it saved
        from Python numbers), which in pieces is freed at each piece's end: each node's forward leaves it
        (``left``), alive through later forwards and until the node's own backward."""
        windows = self.allocator.windows
        ends = [(live, w.start_bytes) for (_, _, live), w in zip(self._opened[1:], windows[1:])]
        ends.append((self.tracker.live_bytes, self.allocator.end_bytes))
        self._rises.append(self.tracker.window_peak_bytes - self._opened[-1][2])
        count = self.loss_index + 1
        left = [0] * count
        for (backward, index, live), window, (live_end, end) in zip(self._opened, windows, ends):
            if not backward:
                left[index] = max(0, end - window.start_bytes - (live_end - live))
        before = np.concatenate([[0], np.cumsum(left)])  # before[j]: left by the nodes before j
        found: tuple[list[int], list[int]] = ([0] * count, [0] * count)
        start = [0] * count
        for (backward, index, _), rise, window in zip(self._opened, self._rises, windows):
            held = int(before[index + 1] if backward else before[index])  # its own too, until its backward
            extra = held + window.peak_bytes - window.start_bytes - rise
            found[backward][index] = max(found[backward][index], extra)
            if backward:
                start[index] = held
        return Hidden(forward=found[0], backward=found[1], backward_start=start, peak_bytes=0)


def pieces_memory(captured: Captured, model: nn.Module, inputs: Inputs, *, pieces: list[Piece], loss_fn: LossFn,
                  device: torch.device) -> PiecesMemory:
    """One step run in ``pieces`` on ``device``: its peak at the allocator (parameters, buffers and inputs counted
    from the start) and what each node's ops allocated inside themselves."""
    runner = _Windows(captured.graph_module, device, pieces)
    with untouched(model), runner.allocator, runner.tracker:
        runner.step(inputs, loss_fn)
    before = runner.allocator.base_bytes
    if before is None:
        before = resident_bytes(model, inputs)
    return PiecesMemory(peak_bytes=before + runner.allocator.peak_bytes, hidden=runner.hidden())


def resident_bytes(model: nn.Module, inputs: Inputs) -> int:
    """Bytes already on the device before a step: the model's parameters and buffers and the inputs, each
    storage once (what the profile's live bytes start from)."""
    sizes = {storage_id(t.untyped_storage()): t.untyped_storage().nbytes()
             for t in [*model.parameters(), *model.buffers(), *tree_leaves((inputs.args, inputs.kwargs))]
             if isinstance(t, torch.Tensor) and not t.is_meta}
    return sum(sizes.values())


def _pieces_within(profile: Profile, ceilings: list[int]) -> list[Piece]:
    """The pieces for the smallest ceiling they fit in (the budget when it is below what the device has)."""
    for ceiling in ceilings[:-1]:
        try:
            return choose_pieces(profile, ceiling)
        except ProfileError:
            continue
    return choose_pieces(profile, ceilings[-1])


def _no_times(count: int) -> StepTimes:
    """Zero times for ``count`` nodes: the memory-only profile pieces are chosen from."""
    return StepTimes(fwd_ms=[0.0] * count, bwd_ms=[0.0] * count, step_fwd_ms=0.0, step_bwd_ms=0.0,
                     checkpoint_overhead_ms=0.0)
