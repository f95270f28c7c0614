"""What every strategy returns: one ``Solution`` record, or ``NoSolution`` saying why there is none."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from planner.memory.model import ChunkPlan


class SolverStatus(str, enum.Enum):
    """How good a strategy's plan is known to be. A ``str`` (its value), so JSON holds ``"OPTIMAL"``
    and ``status == "OPTIMAL"`` keeps working."""

    OPTIMAL = "OPTIMAL"
    """Proven the least recompute of any plan that fits, under the cost model."""
    FEASIBLE = "FEASIBLE"
    """Fits the budget; the time limit (or a restricted search) left better plans possible."""
    FIXED = "FIXED"
    """A fixed placement (the baselines): chosen without looking at the budget, nothing proven."""

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, kw_only=True, slots=True)
class Solution:
    """What a solver returns."""

    plan: ChunkPlan
    """Checkpointed segments as chunk ranges."""
    status: SolverStatus
    """``OPTIMAL`` (proven), ``FEASIBLE`` (time limit reached first) or ``FIXED`` (a baseline)."""
    recompute_us: int
    """Forward time the plan re-runs in backward, microseconds."""
    bound_us: int | None
    """Proven lower bound on the recompute time of any plan that fits, microseconds; None when the
    strategy proves nothing (a baseline, a DP that is not exact)."""
    solve_time_s: float
    """Wall time the strategy took, seconds."""
    saves: frozenset = frozenset()
    """Nodes inside segments whose outputs selective checkpointing keeps (``planner.memory.saves``)."""
    interrupted: bool = False
    """Ctrl-C stopped the search that returned it: the caller returns it as it is, searching no further."""


def best_bound(*bounds_us: int | None) -> int | None:
    """The strongest of several proven lower bounds (None when none is proven)."""
    known = [b for b in bounds_us if b is not None]
    return max(known) if known else None


class NoSolution(Exception):
    """CP-SAT ended without a plan: ``infeasible`` is True when it proved none exists; ``bound_us`` is
    its lower bound on the recompute time of any plan when it stopped at the time limit (None when
    nothing is proven); ``interrupted`` when Ctrl-C stopped it."""

    def __init__(self, infeasible: bool, message: str, bound_us: int | None = None, interrupted: bool = False):
        super().__init__(message)
        self.infeasible = infeasible
        self.bound_us = bound_us
        self.interrupted = interrupted
