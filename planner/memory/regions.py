"""Cuts the graph into chunks: the places where a checkpointed segment may start or end.

A segment is a run of consecutive chunks. Cut positions are chosen at module
boundaries first (between blocks, then between the submodules of a block), and
among positions of equal depth those where the fewest activation bytes cross
the cut, because a segment keeps everything that crosses into it; each block (or
module call, outside the repeated blocks) gets its best cut before any gets two. A position
is never a cut when a tensor crossing it is modified in place later: the
segment would be recomputed from the modified value.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from planner.capture.calls import repeated_blocks
from planner.memory.rules import ANY_RUN, SegmentRules
from planner.profiling.record import Profile


@dataclass(frozen=True, kw_only=True, slots=True)
class Regions:
    """Chunks of the graph, in execution order."""

    starts: tuple[int, ...]
    """Node index at which each chunk starts; chunk ``k`` is ``starts[k]:starts[k+1]``."""
    end: int
    """One past the last node that may be checkpointed (the loss comes after)."""
    checkpointable: tuple[bool, ...]
    """Per chunk: False when checkpointing it would recompute from mutated inputs."""
    blocks: tuple[tuple[int, int], ...] = ()
    """Chunk ranges ``(first, stop)`` of the calls of the model's repeated blocks, if any."""
    block_paths: tuple[str, ...] = ()
    """Module path of each block (children of the largest container of numbered submodules)."""
    capped: bool = False
    """True when the graph has more admissible cut positions than ``max_chunks`` allowed: a plan may
    exist among finer chunks that these do not contain."""
    chains: Mapping[tuple[int, int], tuple[str, ...]] | None = None
    """The chunk ranges ``(first, stop)`` that are the executor's spans (``SegmentRules.spans``: chains
    of module calls), each with its members' paths; only these may be segments. None: any run of
    checkpointable chunks may be one (a rewritten graph)."""
    rules: SegmentRules = ANY_RUN
    """What the executor allows (``planner.rewrite.executor``)."""

    @property
    def n_chunks(self) -> int:
        return len(self.starts)

    def bounds(self, chunk: int) -> tuple[int, int]:
        """Node range ``[first, stop)`` of a chunk."""
        stop = self.starts[chunk + 1] if chunk + 1 < len(self.starts) else self.end
        return self.starts[chunk], stop

    def allows(self, first: int, stop: int) -> bool:
        """Whether chunks ``first..stop-1`` may form one checkpointed segment."""
        return all(self.checkpointable[first:stop]) and (self.chains is None or (first, stop) in self.chains)

    def chunk_of(self) -> list[int]:
        """Chunk index of every node (``-1`` for nodes after ``end``)."""
        owner = [-1] * self.end
        for k in range(self.n_chunks):
            first, stop = self.bounds(k)
            owner[first:stop] = [k] * (stop - first)
        return owner


def checkpointable_end(profile: Profile) -> int:
    """One past the last node a segment may hold (the loss and what follows it are never checkpointed)."""
    return next((i for i, n in enumerate(profile.nodes) if not n.checkpointable), len(profile.nodes))


DEFAULT_CHUNKS = 64
"""Chunks a search starts with when ``max_chunks`` is not given, for a model of up to 32 repeated blocks; one of
33 to ``PER_BLOCK_UP_TO`` starts with two per block (a Llama-70B's 80 layers: 160, 405B's 126: 252), so that
every block can be a segment; deeper chains of small blocks start at 64 again (their solves grow with the
square of the chunks, and finer chunkings follow while they pay)."""
PER_BLOCK_UP_TO = 128
"""Deepest model whose search starts with two cut positions per repeated block."""


def find_regions(profile: Profile, *, max_chunks: int | None = None, rules: SegmentRules = ANY_RUN) -> Regions:
    """Chooses at most ``max_chunks`` chunks for ``profile``'s graph.

    Args:
        profile: the profiled step.
        max_chunks: upper bound on the number of chunks (the solver's size grows
            with its square); None: ``DEFAULT_CHUNKS``, or two per repeated block for a deeper model.
        rules: what the executor allows; with ``rules.spans`` (plans run by module hooks) cuts lie only
            at the edges of spans and only spans may be segments (``Regions.chains``).
    """
    end = checkpointable_end(profile)
    if end == 0:
        return Regions(starts=(), end=0, checkpointable=(), rules=rules)
    last_use = _last_use(profile)
    mutated_after = _mutation_spans(profile)
    crossing = np.zeros(end + 2, dtype=np.int64)  # bytes of activations live across each position
    for s, storage in enumerate(profile.storages):
        if storage.producer >= 0 and storage.producer < end:
            crossing[storage.producer + 1] += storage.nbytes
            crossing[min(last_use[s], end) + 1] -= storage.nbytes
    crossing = np.cumsum(crossing)
    block_paths, block_nodes = find_blocks(profile, end)
    if max_chunks is None:
        per_block = 2 * len(block_nodes)
        max_chunks = per_block if DEFAULT_CHUNKS < per_block <= 2 * PER_BLOCK_UP_TO else DEFAULT_CHUNKS
    block_edges = {b for first, stop in block_nodes for b in (first, stop)}
    # Rank cut positions: block edges, then shallower module boundaries, then, within each block (or,
    # outside the blocks, each module call), fewer crossing bytes first; a block's k-th best cut comes
    # before any block's (k+1)-th, so that every block can be cut inside before any is cut twice.
    found = [s for s in rules.spans if s.hi <= end] if rules.spans is not None else []
    chain_edges = {b for chain in found for b in (chain.lo, chain.hi)}
    groups: dict[tuple[int, int | str | None], list[tuple[int, int]]] = {}  # (depth, block or call): cuts
    for b in range(1, end):
        if rules.spans is not None and b not in chain_edges:
            continue
        if any(p < b <= m for p, m in mutated_after):
            continue
        depth = -1 if b in block_edges else profile.calls.common_depth(b - 1, b)
        unit: int | str | None = next((i for i, (lo, hi) in enumerate(block_nodes) if lo < b < hi), None)
        if unit is None and depth > 0:  # outside the repeated blocks: the module call the cut lies in
            unit = profile.calls.calls[profile.calls.around[b][depth - 1]].entry  # (DenseNet's dense layers)
        groups.setdefault((depth, unit), []).append((int(crossing[b]), b))
    candidates = []
    for (depth, _), members in groups.items():
        for rank, (cross, b) in enumerate(sorted(members)):
            candidates.append((depth, rank, cross, b))
    chosen = sorted(c[-1] for c in sorted(candidates)[: max(0, max_chunks - 1)])
    starts = (0, *chosen)
    stops = (*chosen, end)
    checkpointable = tuple(
        not any(p < first and first <= m < stop for p, m in mutated_after)
        for first, stop in zip(starts, stops)
    )
    index = {b: k for k, b in enumerate(starts)} | {end: len(starts)}
    blocks = tuple((index[first], index[stop]) for first, stop in block_nodes
                   if first in index and stop in index)
    if len(blocks) != len(block_nodes):  # a block edge could not be cut (in-place hazard)
        blocks, block_paths = (), ()
    chains = None
    if rules.spans is not None:
        chains = {(index[c.lo], index[c.hi]): c.members for c in found if c.lo in index and c.hi in index}
    return Regions(starts=starts, end=end, checkpointable=checkpointable, blocks=blocks, block_paths=block_paths,
                   capped=len(candidates) > len(chosen), chains=chains, rules=rules)


def find_blocks(profile: Profile, end: int) -> tuple[tuple[str, ...], list[tuple[int, int]]]:
    """The model's repeated blocks among the modules the graph calls (``scope.repeated_blocks``:
    ``blocks.0``, ``layers.3``, ``transformer.h.11``).

    Returns their paths and node ranges ``[first, stop)``, or nothing when there is no such
    container or its children's calls are not contiguous, disjoint runs of nodes.
    """
    calls = profile.calls.nodes_by_path(end)
    blocks = repeated_blocks(calls)
    if len(blocks) < 2:
        return (), []
    paths = sorted(blocks, key=lambda c: calls[c][0])
    ranges = [(calls[c][0], calls[c][-1] + 1) for c in paths]
    contiguous = all(len(calls[c]) == hi - lo for c, (lo, hi) in zip(paths, ranges))
    disjoint = all(a[1] <= b[0] for a, b in itertools.pairwise(ranges))
    return (tuple(paths), ranges) if contiguous and disjoint else ((), [])


def _last_use(profile: Profile) -> list[int]:
    last = [s.producer for s in profile.storages]
    for i, node in enumerate(profile.nodes):
        for s in node.inputs:
            last[s] = max(last[s], i)
    return last


def _mutation_spans(profile: Profile) -> list[tuple[int, int]]:
    """``(producer, mutating node)`` for every in-place modification of an activation."""
    return [(profile.storages[s].producer, i) for i, node in enumerate(profile.nodes) for s in node.mutates]
