"""Dynamic programming over the chunks: exact under our cost model on chains and residual graphs.

Plans are read left to right as *pieces*: a checkpointed segment ``[a, b)`` or one chunk left
alone. A storage kept for backward is freed at the backward of its earliest *holder*
(``planner.memory.release``): a saver in a chunk left alone, a checkpointed segment starting after
its chunk that reads it, a saver no plan checkpoints. Every holder reads the storage, so by its last
use the plan has decided whether it is kept. The DP carries, at each chunk boundary, one flag per
*open* storage (produced before the boundary, read after it): held by a piece before the boundary
or not. A piece that holds it sets the flag; a storage is alive at backward node t of a piece when
its flag was set before the piece or the piece holds it at or before t, and it is kept through the
forward when its flag is set at its last use. Closed storages are summed in ``M``, the kept bytes
carried forward; the value of each state is an exact step function of ``M`` (no rounding).

On the graphs seen so far (transformers, residual CNNs) at most 2-4 storages are open at a
boundary. When more are, the longest-lived ones are *untracked*: counted as always kept from their
earliest possible release (the conservative reading, whose plans always fit) or as kept only by
what no plan changes (the optimistic one, a relaxation). The conservative DP's plan always fits;
the optimistic one's recompute time is a lower bound on every plan's; with every storage tracked
the two are the same optimum.
"""

from __future__ import annotations

import time

from planner.memory.model import ChunkPlan, MemoryModel
from planner.memory.saves import SaveOptions
from planner.memory.simulate import segment_recompute_us, simulate
from planner.solve.chain_dp import ChainDP
from planner.solve.deadline import Deadline
from planner.solve.result import Failure, NoSolution, Solution, SolverStatus


def rotor(model: MemoryModel, budget_bytes: int, *, deadline: Deadline, options: SaveOptions | None = None) -> Solution:
    """The least-recompute plan under the conservative reading of the cost model (the optimum
    when every storage is tracked). Whole segments: ``options`` are not read (``registry.Capabilities``).

    Raises:
        NoSolution: no plan fits under that reading (INFEASIBLE), or ``deadline`` passed (OUT_OF_TIME).
    """
    began = time.perf_counter()
    if budget_bytes < 0:
        raise NoSolution(Failure.INFEASIBLE, "a negative budget fits no plan")
    dp = ChainDP(model, budget_bytes, optimistic=False, deadline=deadline)
    found = dp.run()
    exact = dp.exact  # then no plan fits with less recompute
    plan = found[0] if found is not None else None
    if plan is None:
        raise NoSolution(Failure.INFEASIBLE,
                         "no plan fits the budget" + ("" if exact else " under the conservative chain model"))
    timeline = simulate(model, plan, stashes=False)
    if timeline.peak_bytes > budget_bytes:
        raise AssertionError(f"rotor plan {plan} simulates to {timeline.peak_bytes} > budget {budget_bytes}")
    return Solution(plan=plan, status=SolverStatus.OPTIMAL if exact else SolverStatus.FEASIBLE,
                    recompute_us=timeline.recompute_us, bound_us=timeline.recompute_us if exact else None,
                    solve_time_s=time.perf_counter() - began)


def rotor_saves(model: MemoryModel, budget_bytes: int, options: SaveOptions, *, deadline: Deadline) -> Solution:
    """The least-recompute plan when each segment may keep one of its save variants
    (``planner.solve.rotor_saves``): FEASIBLE, the optimum within that space (CP-SAT may do better with
    other save sets). Overrides (``must_save`` / ``must_recompute``) are not handled here.

    Raises:
        NoSolution: no plan fits under the conservative reading (INFEASIBLE only when exact), or
            ``deadline`` passed (OUT_OF_TIME).
    """
    began = time.perf_counter()
    dp = ChainDP(model, budget_bytes, optimistic=False, candidates=options.candidates, deadline=deadline)
    found = dp.run()
    if found is None:
        raise NoSolution(Failure.INFEASIBLE if dp.exact else Failure.OUT_OF_TIME, "no plan fits the budget")
    plan, saves = found
    timeline = simulate(model, plan, saves, stashes=False)
    if timeline.peak_bytes > budget_bytes:
        raise AssertionError(f"rotor plan {plan} saving {sorted(saves)} simulates to {timeline.peak_bytes} "
                             f"> budget {budget_bytes}")
    return Solution(plan=plan, status=SolverStatus.FEASIBLE, recompute_us=timeline.recompute_us, bound_us=None,
                    solve_time_s=time.perf_counter() - began, saves=saves)


def relaxed(model: MemoryModel, budget_bytes: int, *, deadline: Deadline | None = None) -> tuple[ChunkPlan, int] | None:
    """The optimum of a relaxation of the cost model, and its recompute time (a lower bound).

    Untracked storages count as never kept, so every plan that fits the real model fits the
    relaxation: its optimum bounds every plan's recompute time from
    below, and when its plan also fits the real model (``simulate``), that plan is optimal.
    None: no plan fits even the relaxation (so none fits).

    Raises:
        NoSolution: ``deadline`` passed (OUT_OF_TIME); None: no deadline.
    """
    if budget_bytes < 0:
        return None
    found = ChainDP(model, budget_bytes, optimistic=True, deadline=deadline).run()
    if found is None:
        return None
    plan = found[0]
    return plan, sum(segment_recompute_us(model, a, b) for a, b in plan)


def smallest_peak(model: MemoryModel) -> tuple[ChunkPlan, bool]:
    """A plan with the smallest peak under the conservative reading, and whether no plan has a smaller
    peak: that reading is exact, or the relaxation's smallest peak meets the plan's.

    Bisects the budget with a forward pass that keeps, per state, only the fewest kept bytes."""
    baseline = simulate(model, (), stashes=False).peak_bytes
    dp = ChainDP(model, baseline, optimistic=False)
    lo, hi = 0, baseline
    best: ChunkPlan = ()
    while lo < hi:
        mid = (lo + hi) // 2
        plan = dp.fits(mid)
        if plan is None:
            lo = mid + 1
        else:
            best, hi = plan, simulate(model, plan, stashes=False).peak_bytes
    if dp.exact:
        return best, True
    # Not every storage tracked, or eager locals the plan decides: the relaxation's smallest peak is a
    # lower bound on every plan's, and proves the plan when they meet.
    relaxation = ChainDP(model, baseline, optimistic=True)
    lo = 0
    while lo < hi:
        mid = (lo + hi) // 2
        if relaxation.fits(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    return best, lo >= simulate(model, best, stashes=False).peak_bytes
