"""``build_model``: the arrays of the memory model (``planner.memory.model.MemoryModel``) from a profile cut
into regions. ``docs/memory-model.md`` derives every array. Torch-free.
"""

from __future__ import annotations

import numpy as np

from planner.memory.excess import openings
from planner.memory.model import NEVER, MemoryModel, prefix_by
from planner.memory.regions import Regions
from planner.profiling.record import Profile


def build_model(profile: Profile, regions: Regions, *, offset=None, sac_op_us: float = 0.0) -> MemoryModel:
    """Precomputes the arrays of the memory model for ``profile`` cut into ``regions``.

    ``offset`` (``planner.distributed.MemoryOffset``): plan-independent bytes added per node to
    the forward and backward constants, and the resident parameter bytes (one rank of a job).
    ``sac_op_us``: time selective checkpointing adds per ATen op of a segment with saves, microseconds
    (``planner.profiling.devices.sac_op_cost`` decides it; a node of unknown op count counts as one op
    when it reads tensors)."""
    nodes = profile.nodes
    n = len(nodes)
    chunk_of = regions.chunk_of() + [-1] * (n - regions.end)
    ckpt_chunk = [regions.checkpointable[k] if k >= 0 else False for k in chunk_of]
    n_storages = len(profile.storages)
    size = np.array([s.nbytes if s.producer >= 0 else 0 for s in profile.storages], dtype=np.int64)
    producer = np.array([s.producer for s in profile.storages], dtype=np.int64)
    producer_chunk = np.array([chunk_of[p] if p >= 0 else -1 for p in producer], dtype=np.int64)
    last_use = producer.copy()
    savers: list[set[int]] = [set() for _ in range(n_storages)]
    consumers: list[set[int]] = [set() for _ in range(n_storages)]
    for i, node in enumerate(nodes):
        for s in node.inputs:
            last_use[s] = max(last_use[s], i)
            consumers[s].add(i)
        for s in node.saves:
            savers[s].add(i)
    first_saver = np.array([min(sv) if sv else NEVER for sv in savers], dtype=np.int64)
    # The model's outputs stay referenced until backward ends whatever the plan: their
    # bytes are part of every measured peak, so they are left out of what a plan can free.
    pinned = {s for i, node in enumerate(nodes) if i >= regions.end for s in node.inputs}
    always = np.array([producer[s] >= 0 and s not in pinned and any(not ckpt_chunk[u] for u in savers[s])
                       for s in range(n_storages)])
    saver_chunks = tuple(() if always[s] or producer[s] < 0 or s in pinned
                         else tuple(sorted({chunk_of[u] for u in savers[s]})) for s in range(n_storages))
    latest_start = _latest_segment_start(regions)
    consumer_chunks = tuple(
        () if producer[s] < 0 or s in pinned else tuple(sorted(
            {chunk_of[w] for w in consumers[s]
             if chunk_of[w] > producer_chunk[s] and ckpt_chunk[w] and latest_start[chunk_of[w]] > producer_chunk[s]}))
        for s in range(n_storages))
    frozen = [[u for u in savers[s] if not ckpt_chunk[u]] for s in range(n_storages)]
    fixed_release = np.array([min(f) if f else NEVER for f in frozen], dtype=np.int64)
    saver_firsts = tuple(
        () if producer[s] < 0 or s in pinned else tuple(sorted(
            (k, min(u for u in savers[s] if chunk_of[u] == k))
            for k in {chunk_of[u] for u in savers[s] if ckpt_chunk[u]}))
        for s in range(n_storages))
    release = first_saver.copy()
    for s in range(n_storages):
        if consumer_chunks[s]:  # a segment starting in the next chunk could hold it from there
            release[s] = min(release[s], regions.starts[producer_chunk[s] + 1])
    # The user's modules' own forward keeps Python locals beyond the traced graph's values: always in
    # plans run by module hooks, only where the plan leaves the module's code alone in fx rewrites
    # (planner.memory.excess); that part is the plan's (``excess``), the rest constant.
    excess = np.array([nd.eager_excess_bytes for nd in nodes], dtype=np.int64)
    if regions.rules.opens_modules:
        openers, around = openings(profile, regions)
        variable = np.array([e if around[t] else 0 for t, e in enumerate(excess)], dtype=np.int64)
    else:
        openers, around, variable = (), tuple(() for _ in nodes), np.zeros(n, dtype=np.int64)
    fwd_peak = np.array([nd.fwd_peak_bytes for nd in nodes], dtype=np.int64) + excess - variable
    has_bwd = np.array([nd.bwd_peak_bytes is not None for nd in nodes])
    bwd_peak = np.array([nd.bwd_peak_bytes or 0 for nd in nodes], dtype=np.int64)
    saved = (first_saver < NEVER) & ~np.isin(np.arange(n_storages), list(pinned))
    fwd_fixed = np.array([s.autocast_cached for s in profile.storages], dtype=bool)
    # The un-checkpointed run keeps every saved storage from its production until the
    # backward of its first saver; subtract that to get the plan-independent part.
    kept_fwd = prefix_by(last_use[saved & ~fwd_fixed] + 1, size[saved & ~fwd_fixed], n)
    kept_bwd = prefix_by(first_saver[saved], size[saved], n)
    own_saved = tuple(tuple(int(x) for x in sorted({x for x in nd.saves if saved[x] and size[x] > 0})) for nd in nodes)
    own_bytes = np.array([int(size[list(own)].sum()) if own else 0 for own in own_saved], dtype=np.int64)
    # A segment is re-run at the backward of its last node that packed anything, parameters included
    # (a frozen Linear saves only its weight; the profile records the pack as ``stop_peak_bytes``), and
    # the re-run stops once that node has packed.
    recompute_at = np.full(regions.n_chunks, -1, dtype=np.int64)
    for k in range(regions.n_chunks):
        for t in range(*regions.bounds(k)):
            if (nodes[t].saves or nodes[t].stop_peak_bytes is not None) and nodes[t].bwd_start_bytes is not None:
                recompute_at[k] = t
    bwd_start = np.array([nd.bwd_start_bytes or 0 for nd in nodes], dtype=np.int64)
    const_recompute = np.array([bwd_start[t] - kept_bwd[t] if t >= 0 else 0 for t in recompute_at], dtype=np.int64)
    if offset is not None:  # one rank of a data-parallel job: sharded or replicated state
        fwd_peak, bwd_peak = fwd_peak + offset.fwd_bytes, bwd_peak + offset.bwd_bytes
        const_recompute = const_recompute + np.where(recompute_at >= 0, offset.bwd_bytes[recompute_at], 0)
    rise = np.array([nd.fwd_peak_bytes - nd.fwd_start_bytes for nd in nodes], dtype=np.int64)
    fwd_us = np.array([round(nd.fwd_ms * 1000) for nd in nodes], dtype=np.int64)
    ops = [nd.aten_ops if nd.aten_ops is not None else int(bool(nd.inputs)) for nd in nodes]
    chunk_cost = np.array([fwd_us[slice(*regions.bounds(k))].sum() for k in range(regions.n_chunks)], dtype=np.int64)
    skip = np.array([0 if t < 0 else int(fwd_us[t + 1:regions.bounds(k)[1]].sum())
                     + (int(fwd_us[t]) if nodes[t].stop_peak_bytes == nodes[t].fwd_start_bytes else 0)
                     for k, t in enumerate(recompute_at)], dtype=np.int64)
    return MemoryModel(
        regions=regions, node_names=tuple(nd.name for nd in nodes), size=size, producer=producer,
        producer_chunk=producer_chunk, last_use=last_use, first_saver=first_saver, release=release,
        fixed_release=fixed_release, saver_firsts=saver_firsts,
        fwd_fixed=fwd_fixed,
        savers=tuple(tuple(sorted(sv)) for sv in savers),
        always_kept=always, saver_chunks=saver_chunks, consumer_chunks=consumer_chunks,
        own_saved=own_saved,
        const_fwd=fwd_peak - kept_fwd, const_bwd=np.where(has_bwd, bwd_peak - kept_bwd + own_bytes, 0),
        has_bwd=has_bwd,
        recompute_at=recompute_at, const_recompute=const_recompute, fwd_rise=rise,
        last_rerun=np.maximum.accumulate(np.where(recompute_at >= 0, np.arange(regions.n_chunks), -1)),
        restore_bytes=np.array([nd.mutated_buffer_bytes for nd in nodes], dtype=np.int64),
        chunk_cost_us=chunk_cost, skip_us=skip, segment_cost_us=round(profile.checkpoint_overhead_ms * 1000),
        node_cost_us=fwd_us,
        sac_chunk_us=np.array([round(sac_op_us * sum(ops[slice(*regions.bounds(k))])) for k in range(regions.n_chunks)],
                              dtype=np.int64),
        step_us=max(1, round(profile.step_ms * 1000)),
        stop_rise=np.array([nd.fwd_peak_bytes - nd.fwd_start_bytes if nd.stop_peak_bytes is None
                            else nd.stop_peak_bytes - nd.fwd_start_bytes for nd in nodes], dtype=np.int64),
        rerun_excess=np.zeros(0, dtype=np.int64) if regions.rules.opens_modules else excess,
        excess=variable, openers=openers, around=around,
        param_bytes=profile.param_bytes if offset is None else offset.param_bytes,
    )


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
