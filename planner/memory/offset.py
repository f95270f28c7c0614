"""Bytes no plan changes that the loop around the step adds to the profiled step, per node (torch-free).

The profile measures one step from no gradients, without the optimizer. ``loop_offset`` turns it into the step
the user runs (``planner.common.loop.TrainingLoop``): the optimizer's state alive throughout; earlier gradients
alive through the forward (Lightning's order) or through forward and backward (accumulation, which adds the new
gradients into them in place: at a node's backward, the full gradients minus those the profile had made by then);
and the moment the optimizer steps, after backward: what is alive then plus what its step allocates.
``planner.distributed.memory`` adds one rank's share of a data-parallel job the same way; ``combined`` sums them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from planner.common.loop import Gradients, TrainingLoop
from planner.profiling.record import Profile

LOG_SOFTMAX = "aten._log_softmax.default"
NLL_LOSS = "aten.nll_loss_forward.default"


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryOffset:
    """Plan-independent bytes added to every node's forward and backward constant."""

    fwd_bytes: np.ndarray
    bwd_bytes: np.ndarray
    param_bytes: int
    """Parameter and buffer bytes resident during the step (one rank's shares under FSDP), for the breakdown."""
    step_bytes: int = 0
    """Live bytes while the optimizer steps after backward (0: that moment is not modelled)."""


def loop_offset(profile: Profile, loop: TrainingLoop, *, accumulated_bytes: int | None = None) -> MemoryOffset:
    """What ``loop`` adds to the profiled step at each node (the module docstring says what).

    ``accumulated_bytes``: earlier gradients held throughout whatever the loop, that many bytes of them (a pipeline
    stage's microbatches accumulate theirs: ``planner.planning.pipelined``); None: the loop's."""
    n = len(profile.nodes)
    state = loop.optimizer.state_bytes if loop.optimizer is not None else 0
    grads = profile.grad_bytes if accumulated_bytes is None else accumulated_bytes
    gradients = loop.gradients if accumulated_bytes is None else Gradients.THROUGHOUT
    held = (loop.batches_held - 1) * profile.input_bytes
    fwd = np.full(n, state + held, dtype=np.int64)
    bwd = np.full(n, state + held, dtype=np.int64)
    if gradients in (Gradients.IN_FORWARD, Gradients.THROUGHOUT):
        fwd += grads
    if gradients is Gradients.THROUGHOUT:  # unknown: as if the profile had made none yet (never under)
        bwd += not_yet_made(profile, grads)
    step = 0
    if loop.optimizer is not None and profile.end_bytes is not None:
        step = profile.end_bytes + state + held + loop.optimizer.step_bytes
    return MemoryOffset(fwd_bytes=fwd, bwd_bytes=bwd, param_bytes=profile.param_bytes, step_bytes=step)


def not_yet_made(profile: Profile, grads: int) -> np.ndarray:
    """Per node, ``grads`` bytes of earlier gradients less those the profiled step has made by that node's backward:
    what accumulation adds at each backward node, backward adding into the earlier gradients in place."""
    return np.array([grads - (node.bwd_grad_bytes or 0) for node in profile.nodes], dtype=np.int64)


def combined(loop: MemoryOffset, rank: MemoryOffset | None, has_bwd: np.ndarray) -> MemoryOffset:
    """The loop's offset with one rank's (``planner.distributed.memory.memory_offset``) on top: their sums, the
    rank's resident parameters, and the rank's share at the last backward added to the optimizer's moment."""
    if rank is None:
        return loop
    last = int(np.flatnonzero(has_bwd)[0]) if has_bwd.any() else 0  # backward ends with the first node's
    return MemoryOffset(fwd_bytes=loop.fwd_bytes + rank.fwd_bytes, bwd_bytes=loop.bwd_bytes + rank.bwd_bytes,
                        param_bytes=rank.param_bytes,
                        step_bytes=loop.step_bytes + int(rank.bwd_bytes[last]) if loop.step_bytes else 0)


def fused_loss(profile: Profile, offset: MemoryOffset) -> MemoryOffset:
    """``offset`` with the step's cross-entropy counted as a compiler runs it. Eager keeps ``log_softmax``'s output
    (the logits' size) from its node to its backward for ``nll_loss``; inductor does not make it: it keeps the
    logits, which the step keeps anyway, and computes their gradient in one fused kernel. So each such output is
    taken off every node's forward from its producer on and every node's backward down to it. For planning a
    compiled step, whose peak is then measured (``planner.compiled.fit``)."""
    fwd, bwd = offset.fwd_bytes.copy(), offset.bwd_bytes.copy()
    for index, storage in enumerate(profile.storages):
        node = profile.nodes[storage.producer] if storage.producer >= 0 else None
        if node is None or storage.op is None or node.kernels[storage.op:storage.op + 1] != (LOG_SOFTMAX,):
            continue
        if not any(index in saver.saves and NLL_LOSS in saver.kernels for saver in profile.nodes):
            continue
        first = storage.producer
        fwd[first:] -= storage.nbytes
        bwd[first:] -= storage.nbytes
    return replace(offset, fwd_bytes=fwd, bwd_bytes=bwd)
