"""The memory model of one training step, and its evaluation for any plan.

``planner.memory.model.MemoryModel`` holds a ``Profile`` and its ``Regions`` as arrays; ``simulate``
evaluates the memory at every forward and backward node for a plan (a set of
checkpointed chunk ranges). The CP-SAT solver encodes exactly these formulas, so
the two always agree; ``docs/memory-model.md`` derives them.

Per node ``t`` (forward, then backward in reverse order) the predicted bytes are
the measured un-checkpointed peak at that node, minus the activations the plan
no longer keeps, plus (backward only) the activations its segment recomputes:

    fwd[t] = const_fwd[t] + sum(size[s] * kept[s]  for s with last_use[s] < t)
    bwd[t] = const_bwd[t] + sum(size[s] * kept[s]  for s with release[s] <= t)
                          + sum(size[s]            for s saved in t's segment,
                                                   produced in it, first saved <= t)

and, where a segment is re-run (just before the backward of its last saving node
t), the same sum with the memory at the start of that backward plus the largest
forward allocation of one of the re-run nodes.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.memory.breakdown import PeakBreakdown
from planner.memory.excess import excess_of
from planner.memory.model import ChunkPlan, MemoryModel, prefix_by
from planner.memory.offload import NO_OFFLOADS, Offloads, relief
from planner.memory.release import release_of
from planner.memory.reruns import kept_given, rerun_chunk, segment_recompute_us
from planner.memory.saves import NEVER, Saves, bump_relief, check_saves, kept_by_saves, rerun_parts

STEP_PHASE = "optimizer step"
"""``Timeline.peak_phase`` of a peak at the optimizer's step (``MemoryModel.step_bytes``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Timeline:
    """Predicted memory of one training step under a plan."""

    plan: ChunkPlan
    fwd_bytes: np.ndarray
    """Predicted peak during each node's forward."""
    bwd_bytes: np.ndarray
    """Predicted peak during each node's backward (-1 where it has none)."""
    peak_bytes: int
    peak_phase: str
    """``forward``, ``backward`` or ``optimizer step`` (``STEP_PHASE``)."""
    peak_node: int
    recompute_us: int
    """Forward time re-run in backward, microseconds."""
    breakdown: PeakBreakdown
    """What the peak is made of."""
    largest_kept: tuple[tuple[str, int, str], ...] = ()
    """Largest activations kept alive at the peak: (producing node, bytes, why it stays)."""
    saves: Saves = frozenset()
    """Nodes inside segments whose outputs selective checkpointing keeps (not re-run)."""
    offloads: Offloads = NO_OFFLOADS
    """Kept activations copied to host memory and back (``planner.memory.offload``)."""


def check_plan(model: MemoryModel, plan: ChunkPlan) -> None:
    """Raises ValueError unless ``plan`` is ordered, disjoint, non-empty ranges of checkpointable chunks."""
    previous = 0
    for first, stop in plan:
        if not previous <= first < stop <= model.n_chunks:
            raise ValueError(f"segment {(first, stop)} is out of order or out of range 0..{model.n_chunks}")
        if not model.regions.allows(first, stop):
            raise ValueError(f"segment {(first, stop)} contains a chunk that cannot be checkpointed, or is not a "
                             "chain of module calls")
        previous = stop


def kept_storages(model: MemoryModel, plan: ChunkPlan) -> np.ndarray:
    """Boolean per storage: does the plan keep it alive until backward?"""
    return kept_given(model, release_of(model, plan))


def simulate(model: MemoryModel, plan: ChunkPlan, saves: Saves = frozenset(), offloads: Offloads = NO_OFFLOADS, *,
             stashes: bool = True) -> Timeline:
    """Predicted memory of every node of one training step under ``plan``, whose segments keep
    the outputs of the ``saves`` nodes (selective checkpointing, ``planner.memory.saves``) and copy the
    ``offloads`` to host memory between their last forward use and their reload (``planner.memory.offload``).
    ``stashes=False``: without the RNG state segments drawing random numbers stash (``stashed_bytes``), as the
    chunk solvers see a plan."""
    check_plan(model, plan)
    saves = frozenset(int(o) for o in saves)
    check_saves(model, plan, saves)
    n = model.n_nodes
    release = release_of(model, plan)
    kept = kept_given(model, release)
    cached, release = kept_by_saves(model, saves, release)
    kept |= cached
    weight = model.size * kept
    fwd = model.const_fwd + prefix_by(model.last_use + 1, weight * ~model.fwd_fixed, n) + excess_of(model, plan)
    kept_bwd = prefix_by(release, weight, n)
    own_kept = np.array([sum(int(weight[x]) for x in own if release[x] <= t) for t, own in enumerate(model.own_saved)],
                        dtype=np.int64)
    recomputed = _recomputed(model, plan) - bump_relief(model, plan, saves)
    bwd = np.where(model.has_bwd, model.const_bwd + kept_bwd - own_kept + recomputed, -1)
    for first, stop in plan:  # the moment a segment is re-run: its last saving chunk, before its backward
        last = rerun_chunk(model, first, stop)
        if last is not None:
            t = model.recompute_at[last]
            rerun = model.const_recompute[last] + kept_bwd[t] + rerun_bytes(model, first, last, stop, saves)
            bwd[t] = max(bwd[t], rerun + (model.stash_bytes if stashes and model.stashes(first, stop) else 0))
    if stashes:
        stashed = stashed_bytes(model, plan)
        fwd = fwd + stashed
        bwd = np.where(model.has_bwd, bwd + stashed, -1)
    fwd_away, bwd_away = relief(model, offloads)
    fwd = fwd - fwd_away
    bwd = np.where(model.has_bwd, bwd - bwd_away, -1)
    fwd_peak, bwd_peak = int(fwd.max(initial=0)), int(bwd.max(initial=0))
    if fwd_peak >= bwd_peak:
        phase, node, peak = "forward", int(fwd.argmax()), fwd_peak
        alive = kept & (model.last_use < node)
        live_kept, bump = int(prefix_by(model.last_use + 1, weight * ~model.fwd_fixed, n)[node] - fwd_away[node]), 0
    else:
        phase, node, peak = "backward", int(bwd.argmax()), bwd_peak
        alive = kept & (release <= node)
        live_kept, bump = int(kept_bwd[node] - bwd_away[node]), int(recomputed[node])
    if model.step_bytes > peak:  # the optimizer's step after backward: activations gone, its own bytes there
        phase, node, peak = STEP_PHASE, n - 1, model.step_bytes
        alive, live_kept, bump = np.zeros_like(kept), 0, 0
    alive[list(_away_at(offloads, phase, node))] = False
    largest = sorted(np.flatnonzero(alive & (model.size > 0)), key=lambda s: -model.size[s])[:3]
    return Timeline(
        plan=tuple(plan), fwd_bytes=fwd, bwd_bytes=bwd, peak_bytes=peak, peak_phase=phase, peak_node=node,
        recompute_us=sum(segment_recompute_us(model, first, stop, saves) for first, stop in plan),
        breakdown=PeakBreakdown(parameters_bytes=model.param_bytes, kept_activations_bytes=live_kept,
                                recomputed_activations_bytes=bump,
                                gradients_inputs_workspace_bytes=peak - model.param_bytes - live_kept - bump),
        largest_kept=tuple((model.node_names[model.producer[s]], int(model.size[s]),
                            _why_kept(model, plan, int(s), saves)) for s in largest),
        saves=saves, offloads=offloads,
    )


def stashed_bytes(model: MemoryModel, plan: ChunkPlan) -> np.ndarray:
    """Per node: bytes of RNG state the plan's checkpoints hold at its forward and at its backward. Each segment
    drawing random numbers stashes ``model.stash_bytes`` when its forward begins and frees them with its first
    node's backward (its re-run draws them once more, which ``simulate`` adds there): the chunk solvers leave this
    out, and ``planner.planning`` solves again under a budget lowered by what it costs."""
    starts = [model.regions.starts[first] for first, stop in plan if model.stashes(first, stop)]
    return prefix_by(np.array(starts, dtype=np.int64), np.full(len(starts), model.stash_bytes, dtype=np.int64),
                     model.n_nodes)


def _away_at(offloads: Offloads, phase: str, node: int) -> list[int]:
    """The offloaded storages off the device at ``node`` in ``phase``."""
    if phase == "forward":
        return [s for s, gone in zip(offloads.storages, offloads.gone) if gone <= node]
    return [s for s, trigger in zip(offloads.storages, offloads.trigger) if trigger < node]


def _why_kept(model: MemoryModel, plan: ChunkPlan, s: int, saves: Saves = frozenset()) -> str:
    if int(model.producer[s]) in saves:
        return "saved inside its checkpointed segment (selective checkpointing)"
    owner = model.regions.chunk_of()
    inside = {k for first, stop in plan for k in range(first, stop)}
    for u in model.savers[s]:
        if u >= len(owner) or owner[u] not in inside:
            return f"saved for backward by {model.node_names[u]}"
    for first, stop in plan:
        if model.producer_chunk[s] < first and any(first <= w < stop for w in model.consumer_chunks[s]):
            return f"input of the checkpointed segment starting at {model.node_names[model.regions.starts[first]]}"
    return "kept for backward"


def freed_bytes(model: MemoryModel, plan: ChunkPlan) -> list[int]:
    """Per segment: activation bytes it no longer keeps until backward (produced inside it),
    minus the inputs it keeps that nothing else would."""
    before, after = kept_storages(model, ()), kept_storages(model, plan)
    out = []
    for first, stop in plan:
        lo, hi = model.regions.starts[first], model.regions.bounds(stop - 1)[1]
        inside = (model.producer >= lo) & (model.producer < hi)
        held = np.array([model.producer_chunk[s] < first and any(first <= w < stop for w in model.consumer_chunks[s])
                         for s in range(len(model.size))], dtype=bool)
        out.append(int(model.size[inside & before & ~after].sum() - model.size[held & after & ~before].sum()))
    return out


def rerun_bytes(model: MemoryModel, first: int, last: int, stop: int, saves: Saves = frozenset()) -> int:
    """Peak bytes the re-run of segment ``[first, stop)`` adds, replayed node by node.

    The segment is re-run up to ``t = recompute_at[last]`` (early stop). While node u
    re-runs, alive are: the storages the segment produced before u that some node up to t
    saves (held until unpacked) or that a later node still reads, u's own allocations (at t only
    those up to its last saved tensor, where the re-run stops: ``stop_rise``), the locals of the model's own
    forward when that is what re-runs (``rerun_excess``), and
    the copies of the buffers the segment mutates (restored after the re-run). Storages cached by
    ``saves`` are counted as kept, not here (``planner.memory.saves.rerun_parts``).
    """
    base, relief, restored = rerun_parts(model, first, last, stop, saves)
    for o in saves:
        if o in relief:
            base = base - relief[o]
    return int(base.max()) + restored


def _recomputed(model: MemoryModel, plan: ChunkPlan) -> np.ndarray:
    """Bytes of recomputed saved activations alive during each node's backward."""
    out = np.zeros(model.n_nodes, dtype=np.int64)
    for first, stop in plan:
        lo, hi = model.regions.starts[first], model.regions.bounds(stop - 1)[1]
        inside = (model.producer >= lo) & (model.producer < hi) & (model.first_saver < hi)
        acc = np.zeros(hi - lo + 1, dtype=np.int64)
        np.add.at(acc, model.first_saver[inside] - lo, model.size[inside])
        out[lo:hi] = np.cumsum(acc)[:-1]
        for t in range(lo, hi):  # what t itself saves is in the measured constant at t
            out[t] -= sum(int(model.size[x]) for x in model.own_saved[t] if lo <= model.producer[x] < hi)
    return out


def recomputed_from(model: MemoryModel) -> np.ndarray:
    """``[a, t]``: recomputed bytes still held at node t's backward when t's segment starts at chunk a
    (saved storages produced from chunk a up to t, first saved at or before t)."""
    n = model.n_nodes
    saved = (model.first_saver < NEVER) & (model.size > 0) & (model.producer_chunk >= 0)
    per_chunk = np.zeros((model.n_chunks + 1, n), dtype=np.int64)
    for j in range(model.n_chunks):
        mask = saved & (model.producer_chunk == j)
        per_chunk[j] = prefix_by(model.first_saver[mask], model.size[mask], n)
    for t, own in enumerate(model.own_saved):  # what t itself saves is in the measured constant at t
        for x in own:
            if model.producer_chunk[x] >= 0:
                per_chunk[model.producer_chunk[x], t] -= model.size[x]
    return np.cumsum(per_chunk[::-1], axis=0)[::-1][: model.n_chunks]
