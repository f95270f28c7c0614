"""CP-SAT questions other than the least recompute: the smallest reachable peak (to explain an
infeasible budget), and the peak the encoding gives a fixed plan (tests check it against
``planner.memory.simulate``). Torch-free."""

from __future__ import annotations

from ortools.sat.python import cp_model

from planner.memory.model import ChunkPlan, MemoryModel
from planner.memory.saves import SaveOptions
from planner.memory.simulate import simulate
from planner.solve.cpsat import _solver, build, read_plan, read_saves, run
from planner.solve.deadline import Deadline
from planner.solve.result import Failure, NoSolution
from planner.solve.rotor import smallest_peak


def min_peak(model: MemoryModel, *, deadline: Deadline, workers: int | None = None,
             options: SaveOptions | None = None) -> ChunkPlan:
    """A plan reaching the smallest predicted peak (used to explain infeasible budgets); with
    ``options``, the smallest under the user's overrides (use ``min_peak_saves`` for its saves)."""
    return min_peak_saves(model, deadline=deadline, workers=workers, options=options)[0]


def min_peak_saves(model: MemoryModel, *, deadline: Deadline, workers: int | None = None,
                   options: SaveOptions | None = None) -> tuple[ChunkPlan, frozenset]:
    """``min_peak`` with the saves of that plan.

    Without ``options`` the chunk DP (``rotor.smallest_peak``) answers, exactly when it tracks every
    storage; otherwise CP-SAT improves on the DP's plan until ``deadline`` and the DP's plan is the
    answer if it finds nothing better (unhinted, CP-SAT found no plan at all in 20 s on a 2700-node model
    at 64 chunks, where the DP is exact in 1 s).

    Raises:
        NoSolution: with ``options``: no plan satisfies them (``infeasible``), or none found in time.
        KeyboardInterrupt: Ctrl-C before CP-SAT found a plan.
    """
    hint = None
    if options is None:
        hint, exact = smallest_peak(model)
        if exact:
            return hint, frozenset()
    try:
        cp, variables, _ = build(model, budget_bytes=None, options=options, deadline=deadline)
    except NoSolution:
        if hint is not None:
            return hint, frozenset()
        raise
    if hint is not None:
        chosen = set(hint)
        for ab, var in variables.segment.items():
            cp.add_hint(var, ab in chosen)
    solver = _solver(deadline.left_s(), workers)
    solver.parameters.optimize_with_core = False  # one integer objective: plain search is faster here
    status, interrupted = run(solver, cp)
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        found = read_plan(solver, variables), read_saves(solver, variables)
        if hint is None or simulate(model, *found).peak_bytes <= simulate(model, hint).peak_bytes:
            return found
    if hint is not None:
        return hint, frozenset()
    if interrupted:
        raise KeyboardInterrupt
    raise NoSolution(Failure.INFEASIBLE if status == cp_model.INFEASIBLE else Failure.OUT_OF_TIME,
                     "CP-SAT could not find the smallest peak")


def encoded_peak(model: MemoryModel, plan: ChunkPlan, *, deadline: Deadline,
                 saves: frozenset = frozenset(), options: SaveOptions | None = None) -> int:
    """The peak the CP-SAT encoding gives a fixed plan (saving ``saves``, candidates of ``options``);
    equals ``simulate(model, plan, saves, stashes=False).peak_bytes`` when the encoding is right (tests check it on
    random graphs and plans)."""
    cp, variables, peak = build(model, budget_bytes=None, options=options)
    assert peak is not None  # build() returns the peak variable when it has no budget
    chosen = set(plan)
    for ab, var in variables.segment.items():
        cp.add(var == int(ab in chosen))
    for o, var in (variables.save or {}).items():
        cp.add(var == int(o in saves))
    solver = _solver(deadline.left_s(), None)
    solver.parameters.optimize_with_core = False
    if run(solver, cp)[0] != cp_model.OPTIMAL:
        raise NoSolution(Failure.OUT_OF_TIME, f"could not evaluate plan {plan}")
    return int(solver.value(peak))
