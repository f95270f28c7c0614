"""Ctrl-C during a solve: the best plan found so far, not a lost search (torch-free).

A strategy offers each plan it finds to an ``Incumbent``; ``interruptible`` runs the strategy and turns a
KeyboardInterrupt raised anywhere in it (a DP, CP-SAT building its model, CP-SAT's search, which
``planner.solve.cpsat.run`` stops cleanly first) into that plan, marked ``FEASIBLE`` and ``interrupted``.
It is the one place ckplan turns Ctrl-C into a plan; before any plan exists, Ctrl-C stays a
KeyboardInterrupt.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from planner.solve.result import Solution, SolverStatus


class Incumbent:
    """The cheapest plan a solve has found so far."""

    def __init__(self) -> None:
        self.best: Solution | None = None

    def offer(self, solution: Solution) -> Solution:
        """Keeps ``solution`` when it re-runs less than the best so far; returns it."""
        if self.best is None or solution.recompute_us < self.best.recompute_us:
            self.best = solution
        return solution


def interruptible(solve: Callable[[Incumbent], Solution]) -> Solution:
    """``solve(incumbent)``, or on Ctrl-C the incumbent's plan (FEASIBLE, no bound, ``interrupted``).

    Raises:
        KeyboardInterrupt: Ctrl-C before any plan was offered.
    """
    incumbent, began = Incumbent(), time.perf_counter()
    try:
        return solve(incumbent)
    except KeyboardInterrupt:
        if incumbent.best is None:
            raise
        return replace(incumbent.best, status=SolverStatus.FEASIBLE, bound_us=None, interrupted=True,
                       solve_time_s=time.perf_counter() - began)
