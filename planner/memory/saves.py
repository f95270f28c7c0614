"""Op-level saves inside checkpointed segments (selective checkpointing), in the memory model's terms.

A node ``o`` inside a checkpointed segment may be *saved*: torch's selective checkpointing caches
its outputs in forward and hands them back when the segment is re-run, instead of running ``o``
again; ``o``'s forward time leaves the recompute cost. What its cached storages then cost depends on
whether some node saves them for backward:

- saved for backward: the re-run's consumers hold the very tensor SAC hands back until their own
  backward, so the storage is *kept* (alive from forward until its release in backward, like the
  activations of an un-checkpointed node) and never recomputed a second time (no copy in the
  segment's backward, none in its re-run);
- nobody saves it (a projection feeding dropout, a Linear feeding a residual add): SAC's cache holds
  it from forward until the re-run of ``o``'s segment pops it, and it dies once the re-run's readers
  are done. Its release is ``o + 1`` (alive at every backward node after ``o``) minus the nodes of
  ``o``'s segment up to the re-run point, whose backward runs after the re-run (``dropped_at``).

Two plan conditions keep this exact (``check_saves``; constraints in CP-SAT): the re-run must reach
``o`` (``partner``), and no later segment may hold an unsaved cached storage as its input (it would
count the storage a second time with another lifetime). Torch-free; ``planner.memory.simulate`` and the
CP-SAT encoding (``planner.solve.cpsat_saves``) use it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.memory.model import NEVER, ChunkPlan, MemoryModel

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
    """Storages node ``o`` produces that a save keeps in SAC's cache: every output it allocates but autocast's
    cached parameter casts, which run past SAC and are made again by the re-run (``planner.rewrite.sac``)."""
    return np.flatnonzero((model.producer == o) & (model.size > 0) & ~model.fwd_fixed)


def until_rerun(model: MemoryModel, o: int) -> np.ndarray:
    """The cached storages of ``o`` nobody saves for backward: SAC's cache alone holds them, until the
    re-run of ``o``'s segment."""
    mine = cached(model, o)
    return mine[model.first_saver[mine] >= NEVER]


def cacheable(model: MemoryModel, o: int) -> bool:
    """Can ``o`` be saved with an exact model: inside a checkpointable chunk, saving tensors for its own
    backward, producing at least one storage besides autocast's cached casts, none of them a model output, and
    a later node of some segment re-running it (``partner``)."""
    owner = model.regions.chunk_of()
    if o >= len(owner) or not model.regions.checkpointable[owner[o]]:
        return False
    if not (model.has_bwd[o] and model.own_saved[o]):
        # o must save for its own backward: then the re-run (which stops early, after the segment's
        # last saving node) can reach o and take its outputs out of SAC's cache; a node after that
        # point would stay cached until the whole segment's backward ends
        return False
    mine = cached(model, o)
    if len(mine) == 0 or (model.last_use[mine] >= model.regions.end).any():
        return False
    return partner(model, o) < model.regions.end


def partner(model: MemoryModel, o: int) -> int:
    """The node that must share ``o``'s segment for a save of ``o`` to be modelled exactly: ``o`` itself
    when it saves one of its own outputs, else the first node that saves one of them, else (outputs
    nobody saves) the first node after ``o`` that saves anything (``model.regions.end`` if none).

    The re-run stops early, as soon as the segment's last saved tensor is packed, and a node packs the
    inputs it saves before its op runs: if ``o`` were the segment's last saving node and saved only its
    inputs, its op would never run again and SAC would hold its cached outputs until the whole segment's
    backward ends. Measured: 48 KiB above the prediction on a chain of Linears. With a later saving node
    in the segment, the re-run runs ``o``'s op, which takes its outputs out of the cache."""
    mine = cached(model, o)
    if any(o in model.savers[s] for s in mine):
        return o
    saved = mine[model.first_saver[mine] < NEVER]
    if len(saved):
        return int(model.first_saver[saved].min())
    k = pack_chunk(model, o + 1)
    return int(model.recompute_at[k]) if k >= 0 else model.regions.end


def pack_chunk(model: MemoryModel, t: int) -> int:
    """Chunk of the first node at or after ``t`` that saves tensors for backward (-1 if none): a segment
    covering it re-runs past ``t``, so ``t``'s backward comes after that re-run."""
    if t >= model.regions.end:
        return -1
    k = int(np.searchsorted(model.regions.starts, t, side="right")) - 1
    if model.recompute_at[k] >= t:
        return k
    later = np.flatnonzero(model.recompute_at[k + 1:] >= 0)
    return k + 1 + int(later[0]) if len(later) else -1


def pack_chunks(model: MemoryModel) -> np.ndarray:
    """``pack_chunk`` of every node before ``model.regions.end``."""
    nxt = np.full(model.n_chunks + 1, -1, dtype=np.int64)
    for k in range(model.n_chunks - 1, -1, -1):
        nxt[k] = k if model.recompute_at[k] >= 0 else nxt[k + 1]
    owner = np.array(model.regions.chunk_of(), dtype=np.int64)
    here = model.recompute_at[owner] >= np.arange(len(owner))
    return np.where(here, owner, nxt[owner + 1])


def segment_of(model: MemoryModel, plan: ChunkPlan) -> np.ndarray:
    """Per node: index of the plan's segment holding it, -1 outside every segment."""
    out = np.full(model.n_nodes, -1, dtype=np.int64)
    for i, (first, stop) in enumerate(plan):
        out[model.regions.starts[first]:model.regions.bounds(stop - 1)[1]] = i
    return out


def check_saves(model: MemoryModel, plan: ChunkPlan, saves: Saves) -> None:
    """Raises ValueError unless every saved node lies inside a segment of ``plan`` with its ``partner``,
    and no other segment reads a cached storage nobody saves (it would hold it as its input)."""
    seg = segment_of(model, plan)
    chunk_seg = np.full(model.n_chunks, -1, dtype=np.int64)
    for i, (first, stop) in enumerate(plan):
        chunk_seg[first:stop] = i
    for o in sorted(saves):
        if not 0 <= o < model.n_nodes or seg[o] < 0:
            raise ValueError(f"saved node {o} is not inside a checkpointed segment of plan {plan}")
        if seg[partner(model, o)] != seg[o]:
            raise ValueError(f"saved node {o} needs node {partner(model, o)}, whose re-run takes its outputs out of "
                             f"SAC's cache, in its segment (plan {plan})")
        for s in until_rerun(model, o):
            if any(chunk_seg[w] not in (-1, seg[o]) for w in model.consumer_chunks[s]):
                raise ValueError(f"saved node {o} caches storage {s}, which a later segment of plan {plan} reads")


def expressible(model: MemoryModel, plan: ChunkPlan, saves: Saves) -> Saves:
    """The ``saves`` that ``check_saves`` accepts under ``plan``, each checked alone (a hand-made policy's keeps:
    those this model cannot express exactly are left out)."""
    ok = set()
    for o in sorted(saves):
        try:
            check_saves(model, plan, frozenset({o}))
        except ValueError:
            continue
        ok.add(o)
    return frozenset(ok)


def kept_by_saves(model: MemoryModel, saves: Saves, release: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(kept, release)``: per storage, cached by a save, and the release index of every storage given
    the plan's (``planner.memory.release.release_of``): a cached storage some node saves is held until
    the backward of its first saver (in the save's segment), one only SAC's cache holds is released at
    ``o + 1`` (see ``dropped_at``)."""
    kept = np.zeros(len(model.size), dtype=bool)
    release = release.copy()
    for o in saves:
        mine = cached(model, o)
        kept[mine] = True
        release[mine] = np.minimum(release[mine], model.first_saver[mine])
        release[until_rerun(model, o)] = o + 1
    return kept, release


def bump_relief(model: MemoryModel, plan: ChunkPlan, saves: Saves) -> np.ndarray:
    """Per node t: bytes the backward at t does not hold although the kept prefix counts them: a save in
    t's segment hands back its cached storage instead of a recomputed copy (``relief_row``), and a cached
    storage nobody saves is gone once the segment's re-run has passed (``dropped_at``)."""
    out = np.zeros(model.n_nodes, dtype=np.int64)
    seg = segment_of(model, plan)
    for o in saves:
        first, stop = plan[seg[o]]
        hi = model.regions.bounds(stop - 1)[1]
        out[o:hi] += relief_row(model, o)[o:hi]
        rerun = max(int(model.recompute_at[k]) for k in range(first, stop))
        out[o + 1:rerun + 1] += dropped_at(model, o)
    return out


def dropped_at(model: MemoryModel, o: int) -> int:
    """Bytes of ``o``'s cached storages nobody saves. Their release is ``o + 1``; the nodes of ``o``'s
    segment after ``o`` up to its re-run point run their backward after the re-run consumed them."""
    return int(model.size[until_rerun(model, o)].sum())


def relief_row(model: MemoryModel, o: int) -> np.ndarray:
    """Per node t: bytes of ``o``'s cached storages counted as recomputed at t's backward (first saved at
    or before t, and not by t itself: what t saves is in the measured constant at t); zero before o."""
    mine = cached(model, o)
    row = np.zeros(model.n_nodes + 1, dtype=np.int64)
    for s in mine:
        if model.first_saver[s] < NEVER:
            row[model.first_saver[s]] += model.size[s]
    row = np.cumsum(row)[:-1]
    for s in mine:
        for u in model.savers[s]:
            if s in model.own_saved[u]:
                row[u] -= model.size[s]
    return row


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
    if len(model.stop_rise):  # the re-run stops once t has saved its last tensor
        base[-1] += model.stop_rise[t] - model.fwd_rise[t]
    if len(model.rerun_excess):  # the model's own forward re-runs: its locals inside the segment too
        base = base + np.maximum(0, model.rerun_excess[lo:t + 1] - model.rerun_excess[lo])
    relief: dict[int, np.ndarray] = {}
    until_of = dict(zip(inside.tolist(), until.tolist()))
    for o in candidates:
        if not lo <= o <= t:
            continue
        arr = np.zeros(t - lo + 2, dtype=np.int64)
        if o == t:  # the re-run starts at o's own backward: o's cache is alive while the replay reaches o
            gone = set(until_rerun(model, o).tolist())  # (the kept sum stops counting it at t)
            for s in cached(model, o):
                if model.release[s] > t or int(s) in gone:
                    arr[0] -= model.size[s]
                    arr[o - lo] += model.size[s]
        for s in cached(model, o):
            if model.first_saver[s] >= NEVER:  # counted as kept, gone once the re-run has read it
                arr[o - lo + 1] += model.size[s]
            elif model.release[s] <= t and int(s) in until_of:
                arr[o - lo + 1] += model.size[s]
                arr[until_of[int(s)] - lo + 1] -= model.size[s]
        arr = np.cumsum(arr)[: t - lo + 1]
        if arr.any():
            relief[o] = arr
    restored = int(model.restore_bytes[lo:model.regions.bounds(stop - 1)[1]].sum())
    return base, relief, restored
