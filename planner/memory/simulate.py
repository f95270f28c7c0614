"""The memory model of one training step, and its evaluation for any plan.

``MemoryModel`` turns a ``Profile`` and its ``Regions`` into arrays; ``simulate``
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

from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from planner.profiling.record import Profile
from planner.memory.regions import Regions
from planner.memory.breakdown import PeakBreakdown
from planner.memory.excess import excess_of, openings
from planner.memory.release import release_of, segment_starts
from planner.memory.saves import NEVER, Saves, bump_relief, check_saves, kept_by_saves, rerun_parts

ChunkPlan = tuple[tuple[int, int], ...]
"""Checkpointed segments as ``(first_chunk, stop_chunk)`` pairs, in order."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryModel:
    """Arrays of the cost model. Storage-indexed arrays cover activations only."""

    regions: Regions
    node_names: tuple[str, ...]
    size: np.ndarray
    """Bytes per storage (int64)."""
    producer: np.ndarray
    """Node that allocated each storage."""
    producer_chunk: np.ndarray
    """Chunk of the producer, -1 outside every chunk."""
    last_use: np.ndarray
    """Last node (forward order) that reads each storage."""
    first_saver: np.ndarray
    """Earliest node that saves each storage for backward (``NEVER`` if none)."""
    release: np.ndarray
    """Earliest node whose backward can free a kept storage, under any plan (a lower bound of
    ``planner.memory.release.release_of``)."""
    fixed_release: np.ndarray
    """Per storage: the first saver that no plan checkpoints (``NEVER`` if none)."""
    saver_firsts: tuple[tuple[tuple[int, int], ...], ...]
    """Per storage: ``(chunk, node)`` for each checkpointable chunk that saves it, ``node`` its first
    saver there (empty when the plan cannot free the storage: model outputs, parameters)."""
    fwd_fixed: np.ndarray
    """True for storages alive through the whole forward whatever the plan (autocast's cache)."""
    always_kept: np.ndarray
    """True when some saver can never be checkpointed."""
    savers: tuple[tuple[int, ...], ...]
    """Nodes that save each storage for backward."""
    own_saved: tuple[tuple[int, ...], ...]
    """Per node t: the storages t saves. They are alive when t's backward starts under any plan
    (kept, held as a segment input, or recomputed) and freed during it, so at t they are part of
    the measured constant, not of the plan-dependent terms (this matters for coarse nodes such as
    a whole block, whose backward frees its saved tensors one by one)."""
    saver_chunks: tuple[tuple[int, ...], ...]
    """Chunks of each storage's savers (empty when always kept or unsaved)."""
    consumer_chunks: tuple[tuple[int, ...], ...]
    """Checkpointable chunks after the producer's chunk that read each storage, where a segment
    starting after the producer's chunk may hold it as its input (always-kept storages included)."""
    const_fwd: np.ndarray
    """Plan-independent part of each node's forward peak, bytes."""
    const_bwd: np.ndarray
    """Plan-independent part of each node's backward peak, bytes."""
    has_bwd: np.ndarray
    """True for nodes that run autograd nodes in backward."""
    recompute_at: np.ndarray
    """Per chunk: last node that packs tensors for backward, parameters included (where a segment
    ending here is recomputed, just before that node's backward, and where its re-run stops); -1 if none."""
    const_recompute: np.ndarray
    """Per chunk: plan-independent bytes when a segment is recomputed at ``recompute_at``."""
    fwd_rise: np.ndarray
    """Per node: bytes its forward allocates on top of what was live (outputs, workspace)."""
    restore_bytes: np.ndarray
    """Per node: bytes of the buffers it mutates, copied while its segment is re-run."""
    segment_cost_us: int
    """Fixed cost of one checkpointed segment (the checkpoint call itself), microseconds."""
    chunk_cost_us: np.ndarray
    """Forward time of each chunk, microseconds (what recomputing it costs)."""
    skip_us: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """Per chunk: forward time a re-run skips when the chunk holds its segment's last saving node: the
    nodes after it, and the node itself when it packs before allocating anything (a Linear saving its
    input: torch stops the re-run before the matmul runs)."""
    step_us: int
    """Time of one un-checkpointed step, microseconds."""
    param_bytes: int
    """Parameters and buffers, bytes."""
    node_cost_us: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """Forward time of each node, microseconds (what a save spares a re-run)."""
    sac_chunk_us: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """Per chunk: time selective checkpointing's dispatch modes add when the chunk is in a segment with
    saves (forward and re-run), microseconds (``sac_op_us`` of ``build_model`` per ATen op)."""
    rerun_excess: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """Per node: bytes the model's own forward keeps alive beyond the graph's values (its Python locals)
    while the node re-runs, for plans that re-run the model's own modules (module hooks); empty when
    the re-run is of the traced graph, which frees each value after its last use."""
    excess: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """Per node: the modules' eager locals the plan decides (``planner.memory.excess``: there when the node
    is outside every segment and a module call around it is not opened); not in ``const_fwd``."""
    openers: tuple = ()
    """What opens each module path (``planner.memory.excess.Opening``), path 0 the root."""
    around: tuple[tuple[int, ...], ...] = ()
    """Per node: the module paths whose calls enclose it (indices into ``openers``)."""
    stop_rise: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """Per node: bytes its forward allocates up to its last saved tensor (``NodeCost.stop_peak_bytes``;
    ``fwd_rise`` when unknown). A re-run ending at the node stops there."""

    @property
    def n_nodes(self) -> int:
        return len(self.node_names)

    @property
    def n_chunks(self) -> int:
        return self.regions.n_chunks

    def varying(self) -> np.ndarray:
        """Storages whose keeping depends on the plan."""
        return np.array([i for i in range(len(self.size))
                         if not self.always_kept[i] and (self.saver_chunks[i] or self.consumer_chunks[i])],
                        dtype=np.int64)


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
    """``forward`` or ``backward``."""
    peak_node: int
    recompute_us: int
    """Forward time re-run in backward, microseconds."""
    breakdown: PeakBreakdown
    """What the peak is made of."""
    largest_kept: tuple[tuple[str, int, str], ...] = ()
    """Largest activations kept alive at the peak: (producing node, bytes, why it stays)."""
    saves: Saves = frozenset()
    """Nodes inside segments whose outputs selective checkpointing keeps (not re-run)."""


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
            (k, min(u for u in savers[s] if chunk_of[u] == k)) for k in {chunk_of[u] for u in savers[s] if ckpt_chunk[u]}))
        for s in range(n_storages))
    release = first_saver.copy()
    for s in range(n_storages):
        if consumer_chunks[s]:  # a segment starting in the next chunk could hold it from there
            release[s] = min(release[s], regions.starts[producer_chunk[s] + 1])
    # The user's modules' own forward keeps Python locals beyond the traced graph's values: always in
    # plans run by module hooks, only where the plan leaves the module's code alone in fx rewrites
    # (planner.memory.excess); that part is the plan's (``excess``), the rest constant.
    excess = np.array([nd.eager_excess_bytes for nd in nodes], dtype=np.int64)
    if regions.chains is None:
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
        restore_bytes=np.array([nd.mutated_buffer_bytes for nd in nodes], dtype=np.int64),
        chunk_cost_us=chunk_cost, skip_us=skip, segment_cost_us=round(profile.checkpoint_overhead_ms * 1000), node_cost_us=fwd_us,
        sac_chunk_us=np.array([round(sac_op_us * sum(ops[slice(*regions.bounds(k))])) for k in range(regions.n_chunks)],
                              dtype=np.int64),
        step_us=max(1, round(profile.step_ms * 1000)),
        stop_rise=np.array([nd.fwd_peak_bytes - nd.fwd_start_bytes if nd.stop_peak_bytes is None
                            else nd.stop_peak_bytes - nd.fwd_start_bytes for nd in nodes], dtype=np.int64),
        rerun_excess=excess if regions.chains is not None else np.zeros(0, dtype=np.int64),
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


def prefix_by(index: np.ndarray, weight: np.ndarray, n: int) -> np.ndarray:
    """``out[t] = sum(weight[i] for index[i] <= t)`` for t in range(n)."""
    acc = np.zeros(n + 1, dtype=np.int64)
    inside = index <= n
    np.add.at(acc, np.clip(index[inside], 0, n), weight[inside])
    return np.cumsum(acc)[:n]


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
    seg_start = segment_starts(model, plan)
    checkpointed = seg_start >= 0
    kept = model.always_kept.copy()
    for s in model.varying():
        p = model.producer_chunk[s]
        kept[s] = (any(not checkpointed[w] for w in model.saver_chunks[s])
                   or any(checkpointed[w] and seg_start[w] > p for w in model.consumer_chunks[s]))
    return kept


def simulate(model: MemoryModel, plan: ChunkPlan, saves: Saves = frozenset()) -> Timeline:
    """Predicted memory of every node of one training step under ``plan``, whose segments keep
    the outputs of the ``saves`` nodes (selective checkpointing, ``planner.memory.saves``)."""
    check_plan(model, plan)
    saves = frozenset(int(o) for o in saves)
    check_saves(model, plan, saves)
    n = model.n_nodes
    cached, release = kept_by_saves(model, saves, release_of(model, plan))
    kept = kept_storages(model, plan) | cached
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
            bwd[t] = max(bwd[t], model.const_recompute[last] + kept_bwd[t] + rerun_bytes(model, first, last, stop, saves))
    fwd_peak, bwd_peak = int(fwd.max(initial=0)), int(bwd.max(initial=0))
    if fwd_peak >= bwd_peak:
        phase, node, peak = "forward", int(fwd.argmax()), fwd_peak
        alive = kept & (model.last_use < node)
        live_kept, bump = int(prefix_by(model.last_use + 1, weight * ~model.fwd_fixed, n)[node]), 0
    else:
        phase, node, peak = "backward", int(bwd.argmax()), bwd_peak
        alive = kept & (release <= node)
        live_kept, bump = int(kept_bwd[node]), int(recomputed[node])
    largest = sorted(np.flatnonzero(alive & (model.size > 0)), key=lambda s: -model.size[s])[:3]
    return Timeline(
        plan=tuple(plan), fwd_bytes=fwd, bwd_bytes=bwd, peak_bytes=peak, peak_phase=phase, peak_node=node,
        recompute_us=sum(segment_recompute_us(model, first, stop, saves) for first, stop in plan),
        breakdown=PeakBreakdown(parameters_bytes=model.param_bytes, kept_activations_bytes=live_kept,
                                recomputed_activations_bytes=bump,
                                gradients_inputs_workspace_bytes=peak - model.param_bytes - live_kept - bump),
        largest_kept=tuple((model.node_names[model.producer[s]], int(model.size[s]),
                            _why_kept(model, plan, s, saves)) for s in largest),
        saves=saves,
    )


def segment_recompute_us(model: MemoryModel, first: int, stop: int, saves: Iterable[int] = ()) -> int:
    """Recompute time of one checkpointed segment (chunks ``[first, stop)``), microseconds: its forward
    time plus the checkpoint call; when it keeps some of ``saves`` (selective checkpointing; other
    segments' saves are ignored), minus those nodes' forward time plus SAC's dispatch charge over it.
    Every strategy and report counts a segment's cost with this (CP-SAT's objective encodes it)."""
    cost = int(model.chunk_cost_us[first:stop].sum()) - rerun_skip_us(model, first, stop) + model.segment_cost_us
    if not saves:
        return cost
    lo, hi = model.regions.starts[first], model.regions.bounds(stop - 1)[1]
    mine = [o for o in saves if lo <= o < hi]
    if mine:
        cost += int(model.sac_chunk_us[first:stop].sum()) - sum(int(model.node_cost_us[o]) for o in mine)
    return cost


def rerun_skip_us(model: MemoryModel, first: int, stop: int) -> int:
    """Forward time of segment ``[first, stop)`` its re-run never runs: torch stops re-running once the
    last saved tensor is back (``MemoryModel.skip_us``; a segment that saves nothing is never re-run)."""
    if not len(model.skip_us):
        return 0
    last = rerun_chunk(model, first, stop)
    if last is None:
        return int(model.chunk_cost_us[first:stop].sum())
    return int(model.skip_us[last] + model.chunk_cost_us[last + 1:stop].sum())


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


def rerun_chunk(model: MemoryModel, first: int, stop: int) -> int | None:
    """Chunk whose backward triggers the re-run of segment ``[first, stop)``: its last saving chunk."""
    return max((k for k in range(first, stop) if model.recompute_at[k] >= 0), default=None)


def rerun_bytes(model: MemoryModel, first: int, last: int, stop: int, saves: Saves = frozenset()) -> int:
    """Peak bytes the re-run of segment ``[first, stop)`` adds, replayed node by node.

    The segment is re-run up to ``t = recompute_at[last]`` (early stop). While node u
    re-runs, alive are: the storages the segment produced before u that some node up to t
    saves (held until unpacked) or that a later node still reads, u's own allocations (at t only
    those up to its last saved tensor, where the re-run stops: ``stop_rise``), the locals of the model's own forward when that is what re-runs (``rerun_excess``), and
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
