"""What every strategy returns: one ``Solution`` record, or ``NoSolution`` saying why there is none."""

from __future__ import annotations

from dataclasses import dataclass

from planner.memory.simulate import ChunkPlan


@dataclass(frozen=True, kw_only=True, slots=True)
class Solution:
    """What a solver returns."""

    plan: ChunkPlan
    status: str
    """``OPTIMAL`` (proven) or ``FEASIBLE`` (time limit reached first)."""
    recompute_us: int
    bound_us: int
    """Proven lower bound on the recompute time of any plan that fits."""
    solve_time_s: float
    saves: frozenset = frozenset()
    """Nodes inside segments whose outputs selective checkpointing keeps (``planner.saves``)."""


class NoSolution(Exception):
    """CP-SAT ended without a plan: ``infeasible`` is True when it proved none exists; ``bound_us`` is
    its lower bound on the recompute time of any plan when it stopped at the time limit."""

    def __init__(self, infeasible: bool, message: str, bound_us: int = 0):
        super().__init__(message)
        self.infeasible = infeasible
        self.bound_us = bound_us
