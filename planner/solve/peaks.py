"""CP-SAT questions other than the least recompute: the smallest reachable peak (to explain an
infeasible budget), and the peak the encoding gives a fixed plan (tests check it against
``planner.memory.simulate``). Torch-free."""

from __future__ import annotations

from ortools.sat.python import cp_model

from planner.memory.saves import SaveOptions
from planner.memory.simulate import ChunkPlan, MemoryModel
from planner.solve.result import NoSolution
from planner.solve.cpsat import _solver, build, read_plan, read_saves


def min_peak(model: MemoryModel, *, time_limit_s: float = 30.0, workers: int | None = None,
             options: SaveOptions | None = None) -> ChunkPlan:
    """A plan reaching the smallest predicted peak (used to explain infeasible budgets); with
    ``options``, the smallest under the user's overrides (use ``min_peak_saves`` for its saves)."""
    return min_peak_saves(model, time_limit_s=time_limit_s, workers=workers, options=options)[0]


def min_peak_saves(model: MemoryModel, *, time_limit_s: float = 30.0, workers: int | None = None,
                   options: SaveOptions | None = None) -> tuple[ChunkPlan, frozenset]:
    """``min_peak`` with the saves of that plan."""
    cp, variables, _ = build(model, budget_bytes=None, options=options)
    solver = _solver(time_limit_s, workers)
    solver.parameters.optimize_with_core = False  # one integer objective: plain search is faster here
    status = solver.solve(cp)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise NoSolution(status == cp_model.INFEASIBLE, "CP-SAT could not find the smallest peak")
    return read_plan(solver, variables), read_saves(solver, variables)


def encoded_peak(model: MemoryModel, plan: ChunkPlan, *, time_limit_s: float = 30.0,
                 saves: frozenset = frozenset(), options: SaveOptions | None = None) -> int:
    """The peak the CP-SAT encoding gives a fixed plan (saving ``saves``, candidates of ``options``);
    equals ``simulate(model, plan, saves).peak_bytes`` when the encoding is right (tests check it on
    random graphs and plans)."""
    cp, variables, peak = build(model, budget_bytes=None, options=options)
    chosen = set(plan)
    for ab, var in variables.segment.items():
        cp.add(var == int(ab in chosen))
    for o, var in (variables.save or {}).items():
        cp.add(var == int(o in saves))
    solver = _solver(time_limit_s, None)
    solver.parameters.optimize_with_core = False
    if solver.solve(cp) != cp_model.OPTIMAL:
        raise NoSolution(False, f"could not evaluate plan {plan}")
    return int(solver.value(peak))
