"""``build_model``: the arrays of the memory model (``planner.memory.model.MemoryModel``) from a profile cut
into regions. ``docs/memory-model.md`` derives every array; each helper here computes one of them, or one
group that shares its inputs, in node and chunk indices, bytes and microseconds. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.memory.excess import openings
from planner.memory.model import NEVER, MemoryModel, prefix_by
from planner.memory.offset import MemoryOffset
from planner.memory.regions import Regions
from planner.profiling.record import Profile


def build_model(profile: Profile, regions: Regions, *, offset: MemoryOffset | None = None, sac_op_us: float = 0.0,
                sac_host_us: float | None = None) -> MemoryModel:
    """Precomputes the arrays of the memory model for ``profile`` cut into ``regions``.

    ``offset`` (``planner.memory.offset.MemoryOffset``): plan-independent bytes added per node to the forward
    and backward constants (the training loop's, one rank's share of a job), the resident parameter bytes, and
    the live bytes while the optimizer steps.
    ``sac_op_us``: time selective checkpointing adds per ATen op of a segment with saves, microseconds
    (``planner.profiling.devices.sac_op_cost`` decides it; a node of unknown op count counts as one op
    when it reads tensors). ``sac_host_us``: for a device that runs kernels behind the host (a GPU), the
    host's own cost per op; SAC's time then shows only where the host falls behind the device; None: always."""
    nodes = profile.nodes
    uses = _storage_uses(profile, regions)
    fixed_release = _fixed_release(uses)
    always_kept = (uses.producer >= 0) & ~uses.pinned & (fixed_release < NEVER)  # a saver no plan checkpoints
    consumer_chunks = _consumer_chunks(uses, regions)
    own_saved = _own_saved(profile, uses)
    kept_bwd = _kept_until_backward(uses, len(nodes))
    has_bwd = np.array([nd.bwd_peak_bytes is not None for nd in nodes])
    fwd_rank, bwd_rank = _rank_bytes(offset, len(nodes))
    eager = _eager_locals(profile, regions)
    recompute_at = _recompute_at(profile, regions)
    node_us = np.array([round(nd.fwd_ms * 1000) for nd in nodes], dtype=np.int64)
    return MemoryModel(
        regions=regions, node_names=tuple(nd.name for nd in nodes), kernels=tuple(nd.kernels for nd in nodes),
        # the un-checkpointed step's storages
        size=uses.size, producer=uses.producer, producer_chunk=uses.producer_chunk, last_use=uses.last_use,
        first_saver=uses.first_saver, savers=uses.savers, fwd_fixed=uses.fwd_fixed, own_saved=own_saved,
        # where a plan can hold them, and so free them
        always_kept=always_kept, fixed_release=fixed_release, release=_release(uses, consumer_chunks, regions),
        saver_chunks=_saver_chunks(uses, always_kept), saver_firsts=_saver_firsts(uses),
        consumer_chunks=consumer_chunks,
        # bytes no plan changes
        const_fwd=_const_fwd(profile, uses, eager.constant + fwd_rank), has_bwd=has_bwd,
        const_bwd=_const_bwd(profile, uses, has_bwd=has_bwd, kept_bwd=kept_bwd, own_saved=own_saved,
                             rank_bytes=bwd_rank),
        param_bytes=profile.param_bytes if offset is None else offset.param_bytes,
        step_bytes=0 if offset is None else offset.step_bytes,
        # re-runs
        recompute_at=recompute_at, last_rerun=_last_rerun(recompute_at),
        const_recompute=_const_recompute(profile, recompute_at, kept_bwd=kept_bwd, rank_bytes=bwd_rank),
        fwd_rise=np.array([nd.fwd_allocator_peak_bytes - nd.fwd_start_bytes for nd in nodes], dtype=np.int64),
        stop_rise=_stop_rise(profile),
        restore_bytes=np.array([nd.mutated_buffer_bytes for nd in nodes], dtype=np.int64),
        # times
        node_cost_us=node_us, chunk_cost_us=_chunk_us(regions, node_us),
        bwd_cost_us=np.array([round(nd.bwd_ms * 1000) for nd in nodes], dtype=np.int64),
        markable=np.array([len(nd.kernels) > 0 for nd in nodes], dtype=bool),
        skip_us=_skip_us(profile, regions, recompute_at, node_us),
        sac_chunk_us=_sac_chunk_us(profile, regions, sac_op_us, sac_host_us),
        segment_cost_us=round(profile.checkpoint_overhead_ms * 1000), step_us=max(1, round(profile.step_ms * 1000)),
        # the modules' Python locals
        excess=eager.decided, rerun_excess=eager.rerun, openers=eager.openers, around=eager.around,
        # the RNG state a segment drawing random numbers stashes
        stash_bytes=profile.rng_state_bytes,
        random_chunks=np.array([any(nd.random for nd in nodes[slice(*regions.bounds(k))])
                                for k in range(regions.n_chunks)], dtype=bool),
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class _Uses:
    """What the un-checkpointed step does with each storage, in node and chunk indices."""

    chunk_of: list[int]
    """Per node: its chunk, -1 past the last chunk (the loss)."""
    checkpointable: list[bool]
    """Per node: whether its chunk may be checkpointed."""
    size: np.ndarray
    """Per storage: bytes, 0 for the model's inputs (int64)."""
    producer: np.ndarray
    """Per storage: the node that allocated it, -1 for the model's inputs."""
    producer_chunk: np.ndarray
    """Per storage: the producer's chunk, -1 outside every chunk."""
    last_use: np.ndarray
    """Per storage: the last node that reads it, its producer when none does."""
    savers: tuple[tuple[int, ...], ...]
    """Per storage: the nodes that save it for backward, ascending."""
    readers: tuple[tuple[int, ...], ...]
    """Per storage: the nodes that read it, ascending."""
    first_saver: np.ndarray
    """Per storage: its earliest saver, ``NEVER`` when none."""
    pinned: np.ndarray
    """Per storage: True when the model's outputs hold it (read after the last chunk)."""
    saved: np.ndarray
    """Per storage: True when saved for backward and not pinned (what a plan can change)."""
    fwd_fixed: np.ndarray
    """Per storage: True when alive through the whole forward whatever the plan (autocast's cache)."""


def _storage_uses(profile: Profile, regions: Regions) -> _Uses:
    """The producer, readers, savers and bytes of every storage, and every node's chunk."""
    nodes, storages = profile.nodes, profile.storages
    chunk_of = regions.chunk_of() + [-1] * (len(nodes) - regions.end)
    producer = np.array([s.producer for s in storages], dtype=np.int64)
    last_use = producer.copy()
    savers: list[set[int]] = [set() for _ in storages]
    readers: list[set[int]] = [set() for _ in storages]
    for i, node in enumerate(nodes):
        for s in node.inputs:
            last_use[s] = max(last_use[s], i)
            readers[s].add(i)
        for s in node.saves:
            savers[s].add(i)
    first_saver = np.array([min(sv) if sv else NEVER for sv in savers], dtype=np.int64)
    # The model's outputs stay referenced until backward ends whatever the plan: their
    # bytes are part of every measured peak, so they are left out of what a plan can free.
    pinned = np.zeros(len(storages), dtype=bool)
    pinned[[s for node in nodes[regions.end:] for s in node.inputs]] = True
    return _Uses(
        chunk_of=chunk_of, checkpointable=[regions.checkpointable[k] if k >= 0 else False for k in chunk_of],
        size=np.array([s.nbytes if s.producer >= 0 else 0 for s in storages], dtype=np.int64), producer=producer,
        producer_chunk=np.array([chunk_of[p] if p >= 0 else -1 for p in producer], dtype=np.int64),
        last_use=last_use, savers=tuple(tuple(sorted(sv)) for sv in savers),
        readers=tuple(tuple(sorted(r)) for r in readers), first_saver=first_saver, pinned=pinned,
        saved=(first_saver < NEVER) & ~pinned, fwd_fixed=np.array([s.autocast_cached for s in storages], dtype=bool))


def _fixed_release(uses: _Uses) -> np.ndarray:
    """Per storage: its first saver that no plan checkpoints, a node index (``NEVER`` when none)."""
    return np.array([min((u for u in sv if not uses.checkpointable[u]), default=NEVER) for sv in uses.savers],
                    dtype=np.int64)


def _saver_chunks(uses: _Uses, always_kept: np.ndarray) -> tuple[tuple[int, ...], ...]:
    """Per storage: the chunks of its savers, ascending (empty when kept whatever the plan)."""
    return tuple(() if always_kept[s] or uses.producer[s] < 0 or uses.pinned[s]
                 else tuple(sorted({uses.chunk_of[u] for u in sv})) for s, sv in enumerate(uses.savers))


def _saver_firsts(uses: _Uses) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per storage: ``(chunk, node)`` for each checkpointable chunk that saves it, ``node`` its first saver there."""
    def firsts(savers: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
        first: dict[int, int] = {}
        for u in savers:  # ascending: the first one seen in a chunk is its first saver
            if uses.checkpointable[u]:
                first.setdefault(uses.chunk_of[u], u)
        return tuple(sorted(first.items()))

    return tuple(() if uses.producer[s] < 0 or uses.pinned[s] else firsts(sv) for s, sv in enumerate(uses.savers))


def _consumer_chunks(uses: _Uses, regions: Regions) -> tuple[tuple[int, ...], ...]:
    """Per storage: the later chunks that read it where a segment could hold it as an input, ascending (chunks)."""
    latest_start = _latest_segment_start(regions)

    def holding(s: int) -> tuple[int, ...]:
        made = uses.producer_chunk[s]
        return tuple(sorted({k for k in (uses.chunk_of[w] for w in uses.readers[s])
                             if k > made and regions.checkpointable[k] and latest_start[k] > made}))

    return tuple(() if uses.producer[s] < 0 or uses.pinned[s] else holding(s) for s in range(len(uses.size)))


def _latest_segment_start(regions: Regions) -> list[int]:
    """Per chunk w: the latest chunk a segment containing w may start at (-1 when none may contain it).
    A storage read in w can be held as a segment's input only if such a segment starts after the chunk
    that produced it (module-hook plans: only chains of module calls are segments)."""
    if regions.chains is None:
        return list(range(regions.n_chunks))
    latest = [-1] * regions.n_chunks
    for first, stop in regions.chains:
        for w in range(first, stop):
            latest[w] = max(latest[w], first)
    return latest


def _release(uses: _Uses, consumer_chunks: tuple[tuple[int, ...], ...], regions: Regions) -> np.ndarray:
    """Per storage: the earliest node whose backward can free it under any plan, a node index (``NEVER`` when none)."""
    release = uses.first_saver.copy()
    for s, held_in in enumerate(consumer_chunks):
        if held_in:  # a segment starting in the next chunk could hold it from there
            release[s] = min(release[s], regions.starts[uses.producer_chunk[s] + 1])
    return release


@dataclass(frozen=True, kw_only=True, slots=True)
class _Locals:
    """The user's modules' Python locals beyond the traced graph's values (``planner.memory.excess``)."""

    constant: np.ndarray
    """Per node: bytes of them every plan's forward has (part of ``const_fwd``)."""
    decided: np.ndarray
    """Per node: bytes of them the plan decides (``MemoryModel.excess``)."""
    rerun: np.ndarray
    """Per node: bytes of them while it re-runs (``MemoryModel.rerun_excess``); empty for traced re-runs."""
    openers: tuple
    """What opens each module path (``MemoryModel.openers``)."""
    around: tuple[tuple[int, ...], ...]
    """Per node: the module paths around it (``MemoryModel.around``)."""


def _eager_locals(profile: Profile, regions: Regions) -> _Locals:
    """Per node, bytes: the modules' eager locals every plan keeps, those the plan decides, and those of a re-run."""
    excess = np.array([nd.eager_excess_bytes for nd in profile.nodes], dtype=np.int64)
    if not regions.rules.opens_modules:  # plans run by module hooks: the user's forward runs everywhere
        return _Locals(constant=excess, decided=np.zeros(len(excess), dtype=np.int64), rerun=excess, openers=(),
                       around=tuple(() for _ in profile.nodes))
    # fx rewrites run a module's own forward only where the plan leaves the module's code alone
    openers, around = openings(profile, regions)
    decided = np.array([e if around[t] else 0 for t, e in enumerate(excess)], dtype=np.int64)
    return _Locals(constant=excess - decided, decided=decided, rerun=np.zeros(0, dtype=np.int64), openers=openers,
                   around=around)


def _own_saved(profile: Profile, uses: _Uses) -> tuple[tuple[int, ...], ...]:
    """Per node: the storages it saves that a plan can change and that have bytes, ascending."""
    return tuple(tuple(int(x) for x in sorted({x for x in nd.saves if uses.saved[x] and uses.size[x] > 0}))
                 for nd in profile.nodes)


def _kept_until_backward(uses: _Uses, n_nodes: int) -> np.ndarray:
    """Per node t: bytes of saved storages the un-checkpointed step holds at t's backward (first saver <= t)."""
    return prefix_by(uses.first_saver[uses.saved], uses.size[uses.saved], n_nodes)


def _rank_bytes(offset, n_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """Per node: bytes one rank of a data-parallel job adds to its forward and its backward (0 on one device)."""
    if offset is None:
        return np.zeros(n_nodes, dtype=np.int64), np.zeros(n_nodes, dtype=np.int64)
    return offset.fwd_bytes, offset.bwd_bytes


def _const_fwd(profile: Profile, uses: _Uses, extra_bytes: np.ndarray) -> np.ndarray:
    """Per node: the plan-independent part of its forward peak plus ``extra_bytes``, bytes."""
    held = uses.saved & ~uses.fwd_fixed  # autocast's cached casts stay through the forward whatever the plan
    peak = np.array([nd.fwd_allocator_peak_bytes for nd in profile.nodes], dtype=np.int64) + extra_bytes
    return peak - prefix_by(uses.last_use[held] + 1, uses.size[held], len(profile.nodes))


def _const_bwd(profile: Profile, uses: _Uses, *, has_bwd: np.ndarray, kept_bwd: np.ndarray,
               own_saved: tuple[tuple[int, ...], ...], rank_bytes: np.ndarray) -> np.ndarray:
    """Per node: the plan-independent part of its backward peak plus ``rank_bytes``, bytes (0 without a backward)."""
    peak = np.array([nd.bwd_allocator_peak_bytes or 0 for nd in profile.nodes], dtype=np.int64) + rank_bytes
    own_bytes = np.array([int(uses.size[list(own)].sum()) if own else 0 for own in own_saved], dtype=np.int64)
    return np.where(has_bwd, peak - kept_bwd + own_bytes, 0)


def _recompute_at(profile: Profile, regions: Regions) -> np.ndarray:
    """Per chunk: its last node that packs tensors for backward, a node index (-1 when none)."""
    # A segment is re-run at the backward of its last node that packed anything, parameters included
    # (a frozen Linear saves only its weight; the profile records the pack as ``stop_peak_bytes``), and
    # the re-run stops once that node has packed.
    nodes = profile.nodes
    recompute_at = np.full(regions.n_chunks, -1, dtype=np.int64)
    for k in range(regions.n_chunks):
        for t in range(*regions.bounds(k)):
            if (nodes[t].saves or nodes[t].stop_peak_bytes is not None) and nodes[t].bwd_start_bytes is not None:
                recompute_at[k] = t
    return recompute_at


def _last_rerun(recompute_at: np.ndarray) -> np.ndarray:
    """Per chunk k: the last chunk up to k with a ``recompute_at``, a chunk index (-1 when none)."""
    return np.maximum.accumulate(np.where(recompute_at >= 0, np.arange(len(recompute_at)), -1))


def _const_recompute(profile: Profile, recompute_at: np.ndarray, *, kept_bwd: np.ndarray,
                     rank_bytes: np.ndarray) -> np.ndarray:
    """Per chunk: plan-independent bytes when a segment is re-run at its ``recompute_at`` (0 when none)."""
    bwd_start = np.array([(nd.bwd_start_bytes or 0) + nd.bwd_start_hidden_bytes for nd in profile.nodes],
                         dtype=np.int64)  # at the allocator
    const = np.array([bwd_start[t] - kept_bwd[t] if t >= 0 else 0 for t in recompute_at], dtype=np.int64)
    return const + np.where(recompute_at >= 0, rank_bytes[recompute_at], 0)


def _stop_rise(profile: Profile) -> np.ndarray:
    """Per node: bytes its forward allocates up to its last saved tensor's pack (its whole rise when unknown)."""
    return np.array([(nd.fwd_peak_bytes if nd.stop_peak_bytes is None else nd.stop_peak_bytes) - nd.fwd_start_bytes
                     for nd in profile.nodes], dtype=np.int64)


def _chunk_us(regions: Regions, node_us: np.ndarray) -> np.ndarray:
    """Per chunk: the forward time of its nodes, microseconds."""
    return np.array([node_us[slice(*regions.bounds(k))].sum() for k in range(regions.n_chunks)], dtype=np.int64)


def _skip_us(profile: Profile, regions: Regions, recompute_at: np.ndarray, node_us: np.ndarray) -> np.ndarray:
    """Per chunk: the forward time a re-run stopping at its ``recompute_at`` skips, microseconds."""
    nodes = profile.nodes
    return np.array([0 if t < 0 else int(node_us[t + 1:regions.bounds(k)[1]].sum())
                     + (int(node_us[t]) if nodes[t].stop_peak_bytes == nodes[t].fwd_start_bytes else 0)
                     for k, t in enumerate(recompute_at)], dtype=np.int64)


def _sac_chunk_us(profile: Profile, regions: Regions, sac_op_us: float, host_us: float | None) -> np.ndarray:
    """Per chunk: the time selective checkpointing's dispatch adds to it, microseconds: ``sac_op_us`` per ATen op.
    With ``host_us`` (a device that runs kernels queued behind the host), SAC's Python runs on the host while
    the device works: it adds only what it makes the host fall behind the chunk's device time, ``max(0, (host +
    sac) x ops - device) - max(0, host x ops - device)``."""
    ops = [nd.aten_ops if nd.aten_ops is not None else int(bool(nd.inputs)) for nd in profile.nodes]
    out = []
    for k in range(regions.n_chunks):
        lo, hi = regions.bounds(k)
        n = sum(ops[lo:hi])
        cost = sac_op_us * n
        if host_us is not None:
            device = sum(nd.fwd_ms for nd in profile.nodes[lo:hi]) * 1000
            cost = max(0.0, (host_us + sac_op_us) * n - device) - max(0.0, host_us * n - device)
        out.append(round(cost))
    return np.array(out, dtype=np.int64)
