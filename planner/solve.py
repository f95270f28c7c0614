"""Chooses the checkpointed segments with OR-Tools CP-SAT: least recompute time under a peak budget.

The model encodes the formulas of ``planner.simulate`` over chunks (see
``docs/memory-model.md``); it never sees torch objects, only the arrays of a
``MemoryModel``. Build, solve and read back are separate functions.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np
from ortools.sat.python import cp_model

from planner.simulate import NEVER, ChunkPlan, MemoryModel, simulate


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


class NoSolution(Exception):
    """CP-SAT ended without a plan: ``infeasible`` is True when it proved none exists."""

    def __init__(self, infeasible: bool, message: str):
        super().__init__(message)
        self.infeasible = infeasible


@dataclass(kw_only=True, slots=True)
class _Vars:
    ckpt: list            # ckpt[k]: chunk k is inside a checkpointed segment
    start: list           # start[k]: a segment starts at chunk k
    same: dict            # same[j, k]: chunks j..k are all in one segment (j <= k)
    kept: dict            # kept[s]: storage s stays alive from forward until its release in backward


def build(model: MemoryModel, *, budget_bytes: int | None) -> tuple[cp_model.CpModel, _Vars, cp_model.IntVar | None]:
    """Builds the CP-SAT model. With ``budget_bytes=None`` it minimises the peak instead
    and returns the peak variable as third element."""
    cp = cp_model.CpModel()
    n_chunks = model.n_chunks
    # ckpt[k]: chunk k is checkpointed; chunks that would recompute from mutated inputs cannot be.
    ckpt = [cp.new_bool_var(f"ckpt[{k}]") if model.regions.checkpointable[k] else cp.new_constant(0)
            for k in range(n_chunks)]
    # start[k]: a segment begins at chunk k (after an un-checkpointed chunk, or a chosen split).
    start = [cp.new_bool_var(f"start[{k}]") for k in range(n_chunks)]
    for k in range(n_chunks):
        cp.add_implication(start[k], ckpt[k])
        cp.add(start[k] >= ckpt[k] - (ckpt[k - 1] if k else 0))
    # same[j, k]: chunks j..k lie in one segment (same[k, k] = ckpt[k]).
    same: dict[tuple[int, int], object] = {}
    for k in range(n_chunks):
        same[k, k] = ckpt[k]
        for j in range(k - 1, -1, -1):
            if not model.regions.checkpointable[j]:
                break
            var = cp.new_bool_var(f"same[{j},{k}]")
            cp.add_bool_and([same[j, k - 1], ckpt[k], start[k].Not()]).only_enforce_if(var)
            cp.add_bool_or([same[j, k - 1].Not(), ckpt[k].Not(), start[k], var])
            same[j, k] = var
    # kept[s]: some un-checkpointed node saves s, or a segment starting after s's chunk reads it.
    kept = {}
    for s in model.varying():
        var = cp.new_bool_var(f"kept[{s}]")
        for w in model.saver_chunks[s]:
            cp.add_bool_or([var, ckpt[w]])
        p = int(model.producer_chunk[s])
        for w in model.consumer_chunks[s]:
            pair = same.get((p, w), cp.new_constant(0))
            cp.add(var >= ckpt[w] - pair)
        kept[int(s)] = var
    variables = _Vars(ckpt=ckpt, start=start, same=same, kept=kept)
    peak = None
    if budget_bytes is None:
        peak = cp.new_int_var(0, int(_upper_bound(model)), "peak")
        limit = peak
    else:
        limit = budget_bytes
    _add_forward_limits(cp, model, variables, limit)
    _add_backward_limits(cp, model, variables, limit)
    # Objective: forward time of every checkpointed chunk (re-run once in backward).
    if peak is None:
        cp.minimize(sum(int(model.chunk_cost_us[k]) * ckpt[k] for k in range(n_chunks)))
    else:
        cp.minimize(peak)
    return cp, variables, peak


def _upper_bound(model: MemoryModel) -> int:
    return int(max(model.const_fwd.max(initial=0), model.const_bwd.max(initial=0)) + 2 * model.size.sum())


def _kept_terms(model: MemoryModel, variables: _Vars) -> tuple[np.ndarray, list]:
    """Indices and variables of the plan-dependent storages."""
    order = np.array(sorted(variables.kept), dtype=np.int64)
    return order, [variables.kept[int(s)] for s in order]


def _add_forward_limits(cp, model: MemoryModel, variables: _Vars, limit) -> None:
    """Forward: at node t, every storage last read before t is alive iff kept."""
    n = model.n_nodes
    fixed = model.size * model.always_kept
    const = model.const_fwd + _prefix(model.last_use + 1, fixed, n)
    order, kept = _kept_terms(model, variables)
    by_time: dict[int, list] = {}
    for s, var in zip(order, kept):
        by_time.setdefault(int(model.last_use[s]) + 1, []).append((int(model.size[s]), var))
    total = int(model.size[order].sum()) if len(order) else 0
    running = 0
    for t in range(n):
        if t in by_time:
            nxt = cp.new_int_var(0, total, f"fwd_kept[{t}]")
            cp.add(nxt == running + sum(c * v for c, v in by_time[t]))
            running = nxt
        if isinstance(running, int) and running == 0:
            if isinstance(limit, int) and const[t] > limit:
                cp.add_bool_or([])  # infeasible whatever the plan
            elif not isinstance(limit, int):
                cp.add(limit >= int(const[t]))
            continue
        cp.add(running + int(const[t]) <= limit)


def _add_backward_limits(cp, model: MemoryModel, variables: _Vars, limit) -> None:
    """Backward: at node t, kept storages released at or after t, plus t's segment's recomputed ones."""
    n = model.n_nodes
    fixed = model.size * model.always_kept
    const = model.const_bwd + _prefix(model.release, fixed, n)
    order, kept = _kept_terms(model, variables)
    by_time: dict[int, list] = {}
    for s, var in zip(order, kept):
        if model.release[s] < NEVER:
            by_time.setdefault(int(model.release[s]), []).append((int(model.size[s]), var))
    total = int(model.size[order].sum()) if len(order) else 0
    owner = model.regions.chunk_of()
    recompute = _recompute_table(model)
    running = 0
    for t in range(n):
        if t in by_time:
            nxt = cp.new_int_var(0, total, f"bwd_kept[{t}]")
            cp.add(nxt == running + sum(c * v for c, v in by_time[t]))
            running = nxt
        if not model.has_bwd[t]:
            continue
        k = owner[t] if t < len(owner) else -1
        bump = []
        if k >= 0:
            bump = [int(b) * variables.same[j, k] for j, b in recompute.get(t, ()) if (j, k) in variables.same]
        expr = running + int(const[t]) + sum(bump)
        if isinstance(expr, int):
            if isinstance(limit, int) and expr > limit:
                cp.add_bool_or([])
            elif not isinstance(limit, int):
                cp.add(limit >= expr)
            continue
        cp.add(expr <= limit)


def _recompute_table(model: MemoryModel) -> dict[int, list[tuple[int, int]]]:
    """``t -> [(chunk j, bytes)]``: saved bytes produced in chunk j and first saved at or before t."""
    n = model.n_nodes
    saved = (model.first_saver < NEVER) & (model.size > 0)
    per_chunk = [_prefix(model.first_saver[saved & (model.producer_chunk == j)],
                         model.size[saved & (model.producer_chunk == j)], n) for j in range(model.n_chunks)]
    table: dict[int, list[tuple[int, int]]] = {}
    for k in range(model.n_chunks):
        lo, hi = model.regions.bounds(k)
        for t in range(lo, hi):
            rows = [(j, int(per_chunk[j][t])) for j in range(k + 1) if per_chunk[j][t]]
            if rows:
                table[t] = rows
    return table


def _prefix(index: np.ndarray, weight: np.ndarray, n: int) -> np.ndarray:
    acc = np.zeros(n + 1, dtype=np.int64)
    inside = index <= n
    np.add.at(acc, np.clip(index[inside], 0, n), weight[inside])
    return np.cumsum(acc)[:n]


def read_plan(solver: cp_model.CpSolver, variables: _Vars) -> ChunkPlan:
    """The segments chosen in a solved model."""
    plan: list[tuple[int, int]] = []
    first = None
    for k, (c, s) in enumerate(zip(variables.ckpt, variables.start)):
        on = bool(solver.value(c))
        if first is not None and (not on or solver.value(s)):
            plan.append((first, k))
            first = None
        if on and first is None:
            first = k
    if first is not None:
        plan.append((first, len(variables.ckpt)))
    return tuple(plan)


def solve(model: MemoryModel, budget_bytes: int, *, time_limit_s: float = 30.0, workers: int | None = None,
          dump_path: str | None = None) -> Solution:
    """The least-recompute plan whose predicted peak fits ``budget_bytes``.

    Raises:
        NoSolution: infeasible (proven), or no plan found within the time limit.
    """
    began = time.perf_counter()
    cp, variables, _ = build(model, budget_bytes=budget_bytes)
    if dump_path:
        cp.export_to_file(dump_path)
    solver = _solver(time_limit_s, workers)
    status = solver.solve(cp)
    elapsed = time.perf_counter() - began
    if status == cp_model.INFEASIBLE:
        raise NoSolution(True, "no plan fits the budget")
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise NoSolution(False, f"CP-SAT found no plan within {time_limit_s:g} s (status "
                                f"{solver.status_name(status)}); raise time_limit_s")
    plan = read_plan(solver, variables)
    timeline = simulate(model, plan)
    if timeline.peak_bytes > budget_bytes:  # the encoding and the simulator must agree
        raise AssertionError(f"solver plan {plan} simulates to {timeline.peak_bytes} > budget {budget_bytes}")
    return Solution(plan=plan, status="OPTIMAL" if status == cp_model.OPTIMAL else "FEASIBLE",
                    recompute_us=timeline.recompute_us, bound_us=int(solver.best_objective_bound),
                    solve_time_s=elapsed)


def min_peak(model: MemoryModel, *, time_limit_s: float = 30.0, workers: int | None = None) -> ChunkPlan:
    """A plan reaching the smallest predicted peak (used to explain infeasible budgets)."""
    cp, variables, _ = build(model, budget_bytes=None)
    solver = _solver(time_limit_s, workers)
    status = solver.solve(cp)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise NoSolution(False, "CP-SAT could not find the smallest peak")
    return read_plan(solver, variables)


def _solver(time_limit_s: float, workers: int | None) -> cp_model.CpSolver:
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit_s)
    solver.parameters.num_workers = workers or min(8, os.cpu_count() or 1)
    return solver
