"""The default strategy (``cpsat`` in the registry): the exact chunk DPs first, CP-SAT where they cannot prove.

Whole segments: the relaxed DP bounds every plan from below and Rotor's DP gives a plan that fits;
when they meet the plan is proven optimal without CP-SAT. Op-level saves: the save-variant DP gives
an incumbent and CP-SAT looks for a strictly cheaper plan for a share of the time limit.
"""

from __future__ import annotations

import time
from dataclasses import replace

from planner.memory.model import MemoryModel
from planner.memory.saves import SaveOptions
from planner.memory.simulate import simulate
from planner.solve.cpsat import search
from planner.solve.deadline import Deadline
from planner.solve.incumbent import Incumbent, interruptible
from planner.solve.result import Failure, NoSolution, Solution, SolverStatus, best_bound
from planner.solve.rotor import relaxed, rotor, rotor_saves

POLISH_SHARE = 1 / 6
"""Share of the time limit CP-SAT gets to beat the DPs' selective plan (5 s of the default 30 s; at least
1 s, never past the deadline), and, before that, to close the whole-segment DPs' gap when they do not
prove their plan (Python locals, many open storages)."""


def solve(model: MemoryModel, budget_bytes: int, *, deadline: Deadline, options: SaveOptions | None = None,
          workers: int | None = None, dump_path: str | None = None) -> Solution:
    """The least-recompute plan whose predicted peak fits ``budget_bytes``.

    Two dynamic programs run first: a relaxation whose optimum bounds every plan from below
    (and is the answer when its plan fits the real model), and the Rotor-style DP, whose plan
    fits. When they meet, that plan is proven optimal without CP-SAT; otherwise CP-SAT searches
    from the DP's plan, which is returned as FEASIBLE if CP-SAT finds nothing better in time.

    With ``options`` (op-level saves, overrides) the DPs, which know neither, give CP-SAT a hint only:
    saves can beat every whole-segment plan, so the relaxation is no bound there.

    Everything stops at ``deadline``: the DPs check it once per chunk, CP-SAT gets the time they leave.
    Ctrl-C once a plan exists returns it (``planner.solve.incumbent``).

    Raises:
        NoSolution: infeasible (proven), or no plan found before the deadline.
    """
    began = time.perf_counter()
    if model.step_bytes > budget_bytes:
        raise NoSolution(Failure.INFEASIBLE, "the optimizer's step, after backward, needs more than the budget "
                         "whatever the plan")
    if options is not None and not options.trivial:
        found = interruptible(lambda best: _with_options(model, budget_bytes, deadline, options, best,
                                                         workers=workers, dump_path=dump_path))
    else:
        found = interruptible(lambda best: _whole_segments(model, budget_bytes, deadline, best, workers=workers,
                                                           dump_path=dump_path))
    return replace(found, solve_time_s=time.perf_counter() - began)


def _whole_segments(model: MemoryModel, budget_bytes: int, deadline: Deadline, incumbent: Incumbent, *,
                    search_s: float | None = None, workers: int | None = None,
                    dump_path: str | None = None) -> Solution:
    """The least-recompute whole-segment plan: the DPs', proven OPTIMAL when they meet, else CP-SAT's from
    it until ``deadline`` (or for ``search_s`` at most).

    Raises:
        NoSolution: infeasible (proven), or no plan found in time."""
    best, bound = _best_whole_segment(model, budget_bytes, deadline, incumbent)
    if bound is None:
        raise NoSolution(Failure.INFEASIBLE, "no plan fits the budget (not even a relaxation of the cost model)")
    if best is not None and best.status == SolverStatus.OPTIMAL:
        return best
    try:
        found = search(model, budget_bytes, hint=best.plan if best else None, workers=workers, dump_path=dump_path,
                       deadline=deadline if search_s is None else deadline.within(search_s), incumbent=incumbent)
    except NoSolution as exc:
        if exc.infeasible or best is None:
            raise
        found = replace(best, status=SolverStatus.FEASIBLE)
    return replace(found, bound_us=best_bound(bound, found.bound_us))


def _best_whole_segment(model: MemoryModel, budget_bytes: int, deadline: Deadline,
                        incumbent: Incumbent) -> tuple[Solution | None, int | None]:
    """The DPs' best whole-segment plan (OPTIMAL when the relaxation's plan fits or Rotor's meets its
    bound) and the relaxation's lower bound; no bound when not even the relaxation fits. Both DPs stop
    at ``deadline``: the relaxation with NoSolution, Rotor with no plan."""
    lower = relaxed(model, budget_bytes, deadline=deadline)
    if lower is None:
        return None, None
    plan, bound = lower
    if simulate(model, plan, stashes=False).peak_bytes <= budget_bytes:
        proven = Solution(plan=plan, status=SolverStatus.OPTIMAL, recompute_us=bound, bound_us=bound, solve_time_s=0.0)
        return incumbent.offer(proven), bound
    try:
        warm = incumbent.offer(rotor(model, budget_bytes, deadline=deadline))
    except NoSolution:
        return None, bound
    return (replace(warm, status=SolverStatus.OPTIMAL, bound_us=bound) if warm.recompute_us <= bound else warm), bound


def _with_options(model: MemoryModel, budget_bytes: int, deadline: Deadline, options: SaveOptions,
                  incumbent: Incumbent, *, workers: int | None, dump_path: str | None) -> Solution:
    """Saves or overrides. Without overrides, an incumbent first: the best whole-segment plan (the DPs',
    or CP-SAT's from it for ``POLISH_SHARE`` of the limit when they do not prove it), and the best plan
    whose segments keep one of their save variants (``planner.solve.rotor_saves``).
    CP-SAT then searches only for strictly cheaper plans, for ``POLISH_SHARE`` of the time limit:
    finding none proves the incumbent optimal (over every save set of the candidates), running out of
    time returns it as FEASIBLE with CP-SAT's bound. With overrides, CP-SAT alone until the deadline,
    from the whole-segment plan as a hint."""
    polish_s = max(1.0, deadline.left_s() * POLISH_SHARE)
    overrides = bool(options.must_save or options.must_recompute)
    best: Solution | None
    if overrides:  # a hint only: the DPs know neither override
        best, _ = _best_whole_segment(model, budget_bytes, deadline, Incumbent())
    else:  # the whole-segment optimum, as solve() finds it, so that saves never re-run more than it
        try:
            best = _whole_segments(model, budget_bytes, deadline, incumbent, search_s=polish_s, workers=workers)
        except NoSolution as exc:
            if exc.infeasible:
                raise
            best = None
        if options.candidates:
            try:
                selective = incumbent.offer(rotor_saves(model, budget_bytes, options, deadline=deadline))
                if best is None or selective.recompute_us < best.recompute_us:
                    best = selective
            except NoSolution:
                pass
    target = None if overrides or best is None else best
    try:  # CP-SAT rarely beats the DPs here (docs/selective.md): a short try when there is an incumbent
        return search(model, budget_bytes, hint=best.plan if best else None,
                      hint_saves=best.saves if best else frozenset(), workers=workers, dump_path=dump_path,
                      deadline=deadline if target is None else deadline.within(polish_s), options=options,
                      below_us=target.recompute_us if target else None, incumbent=incumbent)
    except NoSolution as exc:
        if target is None:
            raise
        if exc.infeasible:  # nothing strictly cheaper exists
            return replace(target, status=SolverStatus.OPTIMAL, bound_us=target.recompute_us)
        return replace(target, status=SolverStatus.FEASIBLE,
                       bound_us=None if exc.bound_us is None else min(exc.bound_us, target.recompute_us))
