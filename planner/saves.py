"""Op-level saves inside checkpointed segments (selective checkpointing), in the memory model's terms.

A node ``o`` inside a checkpointed segment may be *saved*: torch's selective checkpointing caches
its outputs in forward and hands them back when the segment is re-run, instead of running ``o``
again. The consumers re-run in backward then hold those very tensors until their own backward. So
a saved node's cached storages are *kept* (alive from forward until their release in backward, like
the activations of an un-checkpointed node), they are not recomputed a second time (no copy in the
segment's backward, none in its re-run), and ``o``'s forward time leaves the recompute cost.

Only nodes whose every output storage is saved for backward by some node are candidates: then
"kept" is exactly how long SAC's cache and the re-run's consumers hold it. (An output nobody
saves would be cached until the re-run and then dropped — a lifetime this model does not have.)
Torch-free; ``planner.simulate`` and the CP-SAT encoding (``planner.solve_selective``) use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from planner.simulate import ChunkPlan, MemoryModel

Saves = frozenset
"""Saved node indices (each inside a checkpointed segment of the plan)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SaveOptions:
    """What the solver may and must do with single nodes (node indices)."""

    candidates: tuple[int, ...] = ()
    """Nodes whose outputs a checkpointed segment may keep (``cacheable`` ones)."""
    must_save: frozenset[int] = frozenset()
    """Nodes never re-run in backward: outside every segment, or saved."""
    must_recompute: frozenset[int] = frozenset()
    """Nodes re-run in backward: inside a segment and not saved."""

    @property
    def trivial(self) -> bool:
        return not (self.candidates or self.must_save or self.must_recompute)


def cached(model: MemoryModel, o: int) -> np.ndarray:
    """Storages node ``o`` produces that a save keeps (its outputs saved for backward)."""
    return np.flatnonzero((model.producer == o) & (model.size > 0) & (model.first_saver < np.iinfo(np.int64).max // 4))


def cacheable(model: MemoryModel, o: int) -> bool:
    """Can ``o`` be saved with an exact model: inside a checkpointable chunk, saving tensors for its own
    backward, producing at least one storage, every storage it produces that outlives it saved for
    backward, none of them a model output."""
    owner = model.regions.chunk_of()
    if o >= len(owner) or not model.regions.checkpointable[owner[o]]:
        return False
    if not (model.has_bwd[o] and model.own_saved[o]):
        # o must save for its own backward: then the re-run (which stops early, after the segment's
        # last saving node) reaches o and takes its outputs out of SAC's cache; a node after that
        # point would stay cached until the whole segment's backward ends
        return False
    mine = np.flatnonzero((model.producer == o) & (model.size > 0))
    outlive = mine[(model.last_use[mine] > o) | (model.first_saver[mine] < np.iinfo(np.int64).max // 4)]
    if len(outlive) == 0 or model.fwd_fixed[outlive].any():
        return False
    never = np.iinfo(np.int64).max // 4
    return bool((model.first_saver[outlive] < never).all() and (model.last_use[outlive] < model.regions.end).all()
                and partner(model, o) < model.regions.end)


def partner(model: MemoryModel, o: int) -> int:
    """The node that must share ``o``'s segment for a save of ``o`` to be modelled exactly: ``o`` itself
    when it saves one of its own outputs, else the first node that saves one of them.

    The re-run stops early, as soon as the segment's last saved tensor is packed, and a node packs the
    inputs it saves before its op runs: if ``o`` were the segment's last saving node and saved only its
    inputs, its op would never run again and SAC would hold its cached outputs until the whole segment's
    backward ends. Measured: 48 KiB above the prediction on a chain of Linears. With a later saver of its
    output in the segment, the re-run reaches that saver, which reads ``o``'s output from the cache."""
    mine = cached(model, o)
    if any(o in model.savers[s] for s in mine):
        return o
    return int(model.first_saver[mine].min()) if len(mine) else o


def segment_of(model: MemoryModel, plan: ChunkPlan) -> np.ndarray:
    """Per node: index of the plan's segment holding it, -1 outside every segment."""
    out = np.full(model.n_nodes, -1, dtype=np.int64)
    for i, (first, stop) in enumerate(plan):
        out[model.regions.starts[first]:model.regions.bounds(stop - 1)[1]] = i
    return out


def check_saves(model: MemoryModel, plan: ChunkPlan, saves: Saves) -> None:
    """Raises ValueError unless every saved node lies inside a segment of ``plan``."""
    seg = segment_of(model, plan)
    for o in sorted(saves):
        if not 0 <= o < model.n_nodes or seg[o] < 0:
            raise ValueError(f"saved node {o} is not inside a checkpointed segment of plan {plan}")
        if seg[partner(model, o)] != seg[o]:
            raise ValueError(f"saved node {o} needs node {partner(model, o)}, the first saver of its output, "
                             f"in its segment (plan {plan})")


def kept_by_saves(model: MemoryModel, saves: Saves) -> np.ndarray:
    """Boolean per storage: cached by a save."""
    out = np.zeros(len(model.size), dtype=bool)
    for o in saves:
        out[cached(model, o)] = True
    return out


def bump_relief(model: MemoryModel, plan: ChunkPlan, saves: Saves) -> np.ndarray:
    """Per node t: bytes the recomputed-activation term at t no longer holds twice, because a save
    in t's segment hands back its cached storage instead of a recomputed copy."""
    out = np.zeros(model.n_nodes, dtype=np.int64)
    seg = segment_of(model, plan)
    for o in saves:
        for t in range(o, model.n_nodes):
            if seg[t] != seg[o]:
                break
            out[t] += relief_at(model, o, t)
    return out


def relief_at(model: MemoryModel, o: int, t: int) -> int:
    """Bytes of ``o``'s cached storages counted as recomputed at t's backward (first saved at or
    before t, and not by t itself: what t saves is in the measured constant at t)."""
    own = set(model.own_saved[t])
    return int(sum(int(model.size[s]) for s in cached(model, o) if model.first_saver[s] <= t and s not in own))


def rerun_parts(model: MemoryModel, first: int, last: int, stop: int,
                candidates) -> tuple[np.ndarray, dict[int, np.ndarray], int]:
    """The re-run of segment ``[first, stop)`` replayed node by node (see ``simulate.rerun_bytes``):
    ``(base, relief, restored)`` where the bytes while node ``lo + i`` re-runs are
    ``base[i] - sum(relief[o][i] for saved o) + restored``. A saved storage is already counted as kept
    at the re-run (its release is at or before it), so the replay does not count it again."""
    lo, t = model.regions.starts[first], int(model.recompute_at[last])
    inside = np.flatnonzero((model.producer >= lo) & (model.producer <= t) & (model.size > 0))
    held = model.first_saver[inside] <= t
    until = np.where(held, t, np.minimum(model.last_use[inside], t))
    alive = np.zeros(t - lo + 2, dtype=np.int64)
    np.add.at(alive, model.producer[inside] - lo + 1, model.size[inside])
    np.add.at(alive, until - lo + 1, -model.size[inside])
    base = np.cumsum(alive)[: t - lo + 1] + model.fwd_rise[lo:t + 1]
    relief: dict[int, np.ndarray] = {}
    until_of = dict(zip(inside.tolist(), until.tolist()))
    for o in candidates:
        if not lo <= o <= t:
            continue
        arr = np.zeros(t - lo + 2, dtype=np.int64)
        for s in cached(model, o):
            if model.release[s] <= t and int(s) in until_of:
                arr[o - lo + 1] += model.size[s]
                arr[until_of[int(s)] - lo + 1] -= model.size[s]
        arr = np.cumsum(arr)[: t - lo + 1]
        if arr.any():
            relief[o] = arr
    restored = int(model.restore_bytes[lo:model.regions.bounds(stop - 1)[1]].sum())
    return base, relief, restored


def sac_cost_us(model: MemoryModel, plan: ChunkPlan, saves: Saves) -> int:
    """Time selective checkpointing's dispatch modes add to the segments that save something, us."""
    if not saves or not len(model.sac_chunk_us):
        return 0
    seg = segment_of(model, plan)
    using = {int(seg[o]) for o in saves}
    return int(sum(int(model.sac_chunk_us[first:stop].sum()) for i, (first, stop) in enumerate(plan) if i in using))


def saved_cost_us(model: MemoryModel, saves: Saves) -> int:
    """Forward time the saves spare the re-runs, microseconds."""
    return int(sum(int(model.node_cost_us[o]) for o in saves))
