"""The memory model of one training step as arrays: a ``MemoryModel`` (built by
``planner.memory.build.build_model``) is what ``planner.memory.simulate`` evaluates for any plan and the
solvers encode. ``docs/memory-model.md`` derives every array. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from planner.memory.regions import Regions

NEVER = np.iinfo(np.int64).max // 4
"""``first_saver`` of a storage nobody saves, and the release of a storage nothing frees."""

ChunkPlan = tuple[tuple[int, int], ...]
"""Checkpointed segments as ``(first_chunk, stop_chunk)`` pairs, in order."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryModel:
    """Arrays of the cost model. Storage-indexed arrays cover activations only."""

    regions: Regions
    node_names: tuple[str, ...]
    kernels: tuple[tuple[str, ...], ...] = ()
    """Per node, the ops its forward dispatches that write fresh memory (``NodeCost.kernels``): what op-level
    policies keyed on op names (``planner.solve.baselines.op_sac``) read; empty when unknown."""
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
    last_rerun: np.ndarray
    """Per chunk k: the last chunk up to k with a ``recompute_at`` (-1 if none), so that a segment ending
    at k is re-run at that chunk's node (``simulate.rerun_chunk``)."""
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
    step_bytes: int = 0
    """Live bytes while the optimizer steps after backward, which no plan changes (0: not modelled)."""
    bwd_cost_us: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """Backward time of each node, microseconds (what reloads from the host run beside; empty: twice the
    forward's)."""
    markable: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    """Per node: its forward dispatches ops that write fresh memory, which the offload executor finds by their
    names and occurrences (``planner.memory.offload``); empty: every node."""
    stop_rise: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """Per node: bytes its forward allocates up to its last saved tensor (``NodeCost.stop_peak_bytes``;
    ``fwd_rise`` when unknown). A re-run ending at the node stops there."""
    stash_bytes: int = 0
    """Bytes of RNG state on the device that the checkpoint of a segment drawing random numbers stashes
    (``Profile.rng_state_bytes``): held from the segment's forward until its first node's backward, and once
    more while it is re-run. 0: none (a GPU's generators are read into host memory)."""
    random_chunks: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    """Per chunk: some node of it draws random numbers (``NodeCost.random``); empty: none does."""

    @property
    def n_nodes(self) -> int:
        return len(self.node_names)

    @property
    def n_chunks(self) -> int:
        return self.regions.n_chunks

    def stashes(self, first: int, stop: int) -> bool:
        """Whether the segment of chunks ``[first, stop)`` stashes the RNG state (``stash_bytes``)."""
        return bool(self.stash_bytes) and bool(self.random_chunks[first:stop].any())

    def varying(self) -> np.ndarray:
        """Storages whose keeping depends on the plan."""
        return np.array([i for i in range(len(self.size))
                         if not self.always_kept[i] and (self.saver_chunks[i] or self.consumer_chunks[i])],
                        dtype=np.int64)


def prefix_by(index: np.ndarray, weight: np.ndarray, n: int) -> np.ndarray:
    """``out[t] = sum(weight[i] for index[i] <= t)`` for t in range(n)."""
    acc = np.zeros(n + 1, dtype=np.int64)
    inside = index <= n
    np.add.at(acc, np.clip(index[inside], 0, n), weight[inside])
    return np.cumsum(acc)[:n]
