"""The default strategy (``cpsat`` in the registry): the exact chunk DPs first, CP-SAT where they cannot prove.

Whole segments: the relaxed DP bounds every plan from below and Rotor's DP gives a plan that fits;
when they meet the plan is proven optimal without CP-SAT. Op-level saves: the save-variant DP gives
an incumbent and CP-SAT looks for a strictly cheaper plan for a share of the time limit.
"""

from __future__ import annotations

import time
from dataclasses import replace

from planner.memory.saves import SaveOptions
from planner.memory.model import MemoryModel
from planner.memory.simulate import simulate
from planner.solve.cpsat import search
from planner.solve.result import NoSolution, Solution, SolverStatus, best_bound
from planner.solve.rotor import relaxed, rotor, rotor_saves


def solve(model: MemoryModel, budget_bytes: int, *, time_limit_s: float = 30.0, workers: int | None = None,
          dump_path: str | None = None, options: SaveOptions | None = None) -> Solution:
    """The least-recompute plan whose predicted peak fits ``budget_bytes``.

    Two dynamic programs run first: a relaxation whose optimum bounds every plan from below
    (and is the answer when its plan fits the real model), and the Rotor-style DP, whose plan
    fits. When they meet, that plan is proven optimal without CP-SAT; otherwise CP-SAT searches
    from the DP's plan, which is returned as FEASIBLE if CP-SAT finds nothing better in time.

    With ``options`` (op-level saves, overrides) the DPs, which know neither, give CP-SAT a hint only:
    saves can beat every whole-segment plan, so the relaxation is no bound there.

    ``time_limit_s`` bounds the whole call: the DPs give up once it has passed (they check once per
    chunk) and CP-SAT gets the time they leave.

    Ctrl-C once the DPs have a plan returns it (FEASIBLE), wherever CP-SAT was: building its model or
    searching (``cpsat.run``); before that, it raises KeyboardInterrupt.

    Raises:
        NoSolution: infeasible (proven), or no plan found within the time limit.
    """
    if options is not None and not options.trivial:
        return _solve_with_options(model, budget_bytes, time_limit_s=time_limit_s, workers=workers,
                                   dump_path=dump_path, options=options)
    began = time.perf_counter()
    found = _whole_segments(model, budget_bytes, began + time_limit_s, search_s=time_limit_s, workers=workers,
                            dump_path=dump_path)
    return replace(found, solve_time_s=time.perf_counter() - began)


def _whole_segments(model: MemoryModel, budget_bytes: int, deadline: float, *, search_s: float,
                    workers: int | None = None, dump_path: str | None = None) -> Solution:
    """The least-recompute whole-segment plan: the DPs', proven OPTIMAL when they meet, else CP-SAT's from
    it for at most ``search_s`` (within ``deadline``). Ctrl-C returns the DPs' plan (``interrupted``).

    Raises:
        NoSolution: infeasible (proven), or no plan found in time."""
    best, bound = _best_whole_segment(model, budget_bytes, deadline)
    if bound is None:
        raise NoSolution(True, "no plan fits the budget (not even a relaxation of the cost model)")
    if best is not None and best.status == SolverStatus.OPTIMAL:
        return best
    left = min(search_s, max(0.0, deadline - time.perf_counter()))  # the DPs' time counts against the limit
    try:
        found = search(model, budget_bytes, hint=best.plan if best else None, time_limit_s=left, workers=workers,
                       dump_path=dump_path)
    except KeyboardInterrupt:  # Ctrl-C before CP-SAT's search began (while its model was built)
        if best is None:
            raise
        found = replace(best, status=SolverStatus.FEASIBLE, interrupted=True)
    except NoSolution as exc:
        if exc.infeasible or best is None:
            raise
        found = replace(best, status=SolverStatus.FEASIBLE, interrupted=exc.interrupted)
    return replace(found, bound_us=best_bound(bound, found.bound_us))


def _best_whole_segment(model: MemoryModel, budget_bytes: int,
                        deadline: float) -> tuple[Solution | None, int | None]:
    """The DPs' best whole-segment plan (OPTIMAL when the relaxation's plan fits or Rotor's meets its
    bound) and the relaxation's lower bound; no bound when not even the relaxation fits. Both DPs stop
    at ``deadline`` (``time.perf_counter()``): the relaxation with NoSolution, Rotor with no plan."""
    lower = relaxed(model, budget_bytes, deadline=deadline)
    if lower is None:
        return None, None
    plan, bound = lower
    if simulate(model, plan).peak_bytes <= budget_bytes:
        return Solution(plan=plan, status=SolverStatus.OPTIMAL, recompute_us=bound, bound_us=bound, solve_time_s=0.0), bound
    try:
        warm = rotor(model, budget_bytes, time_limit_s=max(0.0, deadline - time.perf_counter()))
    except NoSolution:
        return None, bound
    return (replace(warm, status=SolverStatus.OPTIMAL, bound_us=bound) if warm.recompute_us <= bound else warm), bound


POLISH_SHARE = 1 / 6
"""Share of ``time_limit_s`` CP-SAT gets to beat the DPs' selective plan (5 s of the default 30 s; at least
1 s, never past the limit), and, before that, to close the whole-segment DPs' gap when they do not
prove their plan (Python locals, many open storages)."""


def _solve_with_options(model: MemoryModel, budget_bytes: int, *, time_limit_s: float, workers: int | None,
                        dump_path: str | None, options: SaveOptions) -> Solution:
    """Saves or overrides. Without overrides, an incumbent first: the best whole-segment plan (the DPs',
    or CP-SAT's from it for ``POLISH_SHARE`` of the limit when they do not prove it), and the best plan
    whose segments keep one of their save variants (``planner.rotor_saves``).
    CP-SAT then searches only for strictly cheaper plans, for ``POLISH_SHARE`` of the time limit:
    finding none proves the incumbent optimal (over every save set of the candidates), running out of
    time returns it as FEASIBLE with CP-SAT's bound. With overrides, CP-SAT alone for the whole time
    limit, from the whole-segment plan as a hint."""
    began = time.perf_counter()
    overrides = bool(options.must_save or options.must_recompute)
    if overrides:  # a hint only
        best, _ = _best_whole_segment(model, budget_bytes, began + time_limit_s)
    else:  # the whole-segment optimum, as solve() finds it, so that saves never re-run more than it
        try:
            best = _whole_segments(model, budget_bytes, began + time_limit_s, workers=workers,
                                   search_s=max(1.0, time_limit_s * POLISH_SHARE))
        except NoSolution as exc:
            if exc.infeasible:
                raise
            best = None
        if best is not None and best.interrupted:
            return replace(best, solve_time_s=time.perf_counter() - began)
    if not overrides and options.candidates:
        try:
            selective = rotor_saves(model, budget_bytes, options, deadline=began + time_limit_s)
            if best is None or selective.recompute_us < best.recompute_us:
                best = selective
        except NoSolution:
            pass
        except KeyboardInterrupt:  # Ctrl-C: the whole-segment plan stands, if there is one
            if best is None:
                raise
            return _stopped(best, began)
    incumbent = None if overrides or best is None else best
    left = max(0.0, time_limit_s - (time.perf_counter() - began))  # the DPs' time counts against the limit
    if incumbent is not None:  # CP-SAT rarely beats the DPs here (docs/selective.md): a short try
        left = min(left, max(1.0, time_limit_s * POLISH_SHARE))
    try:
        found = search(model, budget_bytes, hint=best.plan if best else None, hint_saves=best.saves if best else frozenset(),
                       time_limit_s=left, workers=workers, dump_path=dump_path, options=options,
                       below_us=incumbent.recompute_us if incumbent else None)
    except KeyboardInterrupt:  # Ctrl-C before CP-SAT's search began (while its model was built)
        if incumbent is None:
            raise
        return _stopped(incumbent, began)
    except NoSolution as exc:
        if incumbent is None:
            raise
        if exc.infeasible:  # nothing strictly cheaper exists
            found = replace(incumbent, status=SolverStatus.OPTIMAL, bound_us=incumbent.recompute_us)
        else:
            found = replace(incumbent, status=SolverStatus.FEASIBLE,
                            bound_us=None if exc.bound_us is None else min(exc.bound_us, incumbent.recompute_us))
    return replace(found, solve_time_s=time.perf_counter() - began)


def _stopped(incumbent: Solution, began: float) -> Solution:
    """The DPs' plan when Ctrl-C stopped the solve before CP-SAT could improve on it: FEASIBLE, no bound."""
    return replace(incumbent, status=SolverStatus.FEASIBLE, bound_us=None, solve_time_s=time.perf_counter() - began)
