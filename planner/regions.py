"""Cuts the graph into chunks: the places where a checkpointed segment may start or end.

A segment is a run of consecutive chunks. Cut positions are chosen at module
boundaries first (between blocks, then between the submodules of a block), and
among positions of equal depth those where the fewest activation bytes cross
the cut, because a segment keeps everything that crosses into it. A position
is never a cut when a tensor crossing it is modified in place later: the
segment would be recomputed from the modified value.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.costs import Profile


@dataclass(frozen=True, kw_only=True, slots=True)
class Regions:
    """Chunks of the graph, in execution order."""

    starts: tuple[int, ...]
    """Node index at which each chunk starts; chunk ``k`` is ``starts[k]:starts[k+1]``."""
    end: int
    """One past the last node that may be checkpointed (the loss comes after)."""
    checkpointable: tuple[bool, ...]
    """Per chunk: False when checkpointing it would recompute from mutated inputs."""

    @property
    def n_chunks(self) -> int:
        return len(self.starts)

    def bounds(self, chunk: int) -> tuple[int, int]:
        """Node range ``[first, stop)`` of a chunk."""
        stop = self.starts[chunk + 1] if chunk + 1 < len(self.starts) else self.end
        return self.starts[chunk], stop

    def chunk_of(self) -> list[int]:
        """Chunk index of every node (``-1`` for nodes after ``end``)."""
        owner = [-1] * self.end
        for k in range(self.n_chunks):
            first, stop = self.bounds(k)
            owner[first:stop] = [k] * (stop - first)
        return owner


def find_regions(profile: Profile, *, max_chunks: int = 64) -> Regions:
    """Chooses at most ``max_chunks`` chunks for ``profile``'s graph.

    Args:
        profile: the profiled step.
        max_chunks: upper bound on the number of chunks (the solver's size grows
            with its square).
    """
    nodes = profile.nodes
    end = next((i for i, n in enumerate(nodes) if not n.checkpointable), len(nodes))
    if end == 0:
        return Regions(starts=(), end=0, checkpointable=())
    last_use = _last_use(profile)
    mutated_after = _mutation_spans(profile)
    crossing = np.zeros(end + 2, dtype=np.int64)  # bytes of activations live across each position
    for s, storage in enumerate(profile.storages):
        if storage.producer >= 0 and storage.producer < end:
            crossing[storage.producer + 1] += storage.nbytes
            crossing[min(last_use[s], end) + 1] -= storage.nbytes
    crossing = np.cumsum(crossing)
    candidates = []
    for b in range(1, end):
        if any(p < b <= m for p, m in mutated_after):
            continue
        depth = _common_depth(nodes[b - 1].scope, nodes[b].scope)
        candidates.append((depth, int(crossing[b]), b))
    chosen = sorted(b for _, _, b in sorted(candidates)[: max(0, max_chunks - 1)])
    starts = (0, *chosen)
    stops = (*chosen, end)
    checkpointable = tuple(
        not any(p < first and first <= m < stop for p, m in mutated_after)
        for first, stop in zip(starts, stops)
    )
    return Regions(starts=starts, end=end, checkpointable=checkpointable)


def _last_use(profile: Profile) -> list[int]:
    last = [s.producer for s in profile.storages]
    for i, node in enumerate(profile.nodes):
        for s in node.inputs:
            last[s] = max(last[s], i)
    return last


def _mutation_spans(profile: Profile) -> list[tuple[int, int]]:
    """``(producer, mutating node)`` for every in-place modification of an activation."""
    return [(profile.storages[s].producer, i) for i, node in enumerate(profile.nodes) for s in node.mutates]


def _common_depth(a: tuple[str, ...], b: tuple[str, ...]) -> int:
    depth = 0
    for x, y in zip(a, b):
        if x != y:
            break
        depth += 1
    return depth
