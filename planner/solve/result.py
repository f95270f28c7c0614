"""What every strategy returns: one ``Solution`` record, or ``NoSolution`` saying why there is none."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from planner.memory.model import ChunkPlan
from planner.memory.offload import NO_OFFLOADS, Offloads


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
    offloads: Offloads = NO_OFFLOADS
    """Kept activations the plan copies to host memory and back (``planner.memory.offload``)."""
    interrupted: bool = False
    """Ctrl-C stopped the solve that returned it (``planner.solve.incumbent``): the caller returns it as it
    is, searching no further."""


def best_bound(*bounds_us: int | None) -> int | None:
    """The strongest of several proven lower bounds (None when none is proven)."""
    known = [b for b in bounds_us if b is not None]
    return max(known) if known else None


class Failure(str, enum.Enum):
    """Why a strategy returned no plan."""

    INFEASIBLE = "infeasible"
    """Proven: no plan fits (under the strategy's reading of the cost model)."""
    OUT_OF_TIME = "out of time"
    """The deadline passed before a plan was found; nothing is proven."""


class NoSolution(Exception):
    """A strategy ended without a plan, and why (``failure``). ``bound_us``: its lower bound on the recompute
    time of any plan when it stopped at the deadline (None when nothing is proven)."""

    def __init__(self, failure: Failure, message: str, bound_us: int | None = None):
        super().__init__(message)
        self.failure = failure
        self.bound_us = bound_us

    @property
    def infeasible(self) -> bool:
        return self.failure is Failure.INFEASIBLE
