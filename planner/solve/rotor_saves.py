"""The saves the chunk DP may give one segment (selective checkpointing), and what they change there.

CP-SAT chooses saves node by node; the DP (``planner.solve.rotor``) gives each checkpointed segment a few
*save variants* instead: the segment's candidates sorted by forward time per cached byte, and the
prefixes of that order (none, the best one, the best two, ...). Within that space the DP is exact,
so it finds in about a second what CP-SAT needs tens of seconds to approach; CP-SAT then only has
to improve on it or prove it optimal. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.memory.model import MemoryModel
from planner.memory.saves import NEVER, cached, partner, relief_row, until_rerun

PREFIXES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
"""Prefix lengths tried per segment (plus none and all of them)."""


@dataclass(frozen=True, slots=True)
class Variant:
    """One save set of one segment ``[lo, hi)`` (nodes), and what it does there."""

    saves: frozenset
    spared_us: int
    """Forward time the saves spare the re-run, minus SAC's dispatch cost over the segment."""
    kept: tuple[int, ...]
    """Cached storages some node saves for backward: kept (model release)."""
    held: tuple[int, ...]
    """Cached storages nobody saves, held by SAC's cache until the re-run."""
    relief: np.ndarray
    """Per node of the segment: bytes the recomputed term no longer counts (``relief_row``)."""


@dataclass(frozen=True, slots=True)
class _Candidate:
    node: int
    partner: int
    cost_us: int
    density: float
    kept: tuple[int, ...]
    held: tuple[int, ...]
    relief: np.ndarray
    """``planner.memory.saves.relief_row`` of the node."""


class SaveTable:
    """What each candidate caches and spares, computed once for all segments."""

    def __init__(self, model: MemoryModel, candidates: tuple[int, ...], untracked: set[int]):
        self.m = model
        self.items = []
        for o in candidates:
            mine, held = cached(model, o), until_rerun(model, o)
            if model.node_cost_us[o] <= 0 or any(int(s) in untracked for s in held):
                continue  # the DP could not promise that no later segment reads a held storage
            self.items.append(_Candidate(
                node=o, partner=partner(model, o), cost_us=int(model.node_cost_us[o]),
                density=model.node_cost_us[o] / max(1, int(model.size[mine].sum())),
                kept=tuple(int(s) for s in mine if model.first_saver[s] < NEVER),
                held=tuple(int(s) for s in held), relief=relief_row(model, o)))
        self.items.sort(key=lambda c: (-c.density, c.node))

    def variants(self, a: int, b: int) -> list[Variant]:
        """The save variants of segment ``[a, b)`` (chunks); the first is "no saves". A candidate
        qualifies when its ``partner`` lies in the segment."""
        m = self.m
        lo, hi = m.regions.starts[a], m.regions.bounds(b - 1)[1]
        # a later segment must not hold what only SAC's cache keeps (planner.memory.saves.check_saves)
        inside = [c for c in self.items if lo <= c.node < hi and lo <= c.partner < hi
                  and all(w < b for h in c.held for w in m.consumer_chunks[h])]
        sac = int(m.sac_chunk_us[a:b].sum()) if len(m.sac_chunk_us) else 0
        out = [Variant(frozenset(), 0, (), (), np.zeros(hi - lo, dtype=np.int64))]
        for k in sorted({k for k in PREFIXES if k < len(inside)} | ({len(inside)} if inside else set())):
            chosen = inside[:k]
            if sum(c.cost_us for c in chosen) <= sac:
                continue  # no faster than no saves, and never smaller
            out.append(Variant(saves=frozenset(c.node for c in chosen),
                               spared_us=sum(c.cost_us for c in chosen) - sac,
                               kept=tuple(s for c in chosen for s in c.kept),
                               held=tuple(h for c in chosen for h in c.held),
                               relief=sum((c.relief[lo:hi] for c in chosen), np.zeros(hi - lo, dtype=np.int64))))
        return out

