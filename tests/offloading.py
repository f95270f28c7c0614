"""A planned module with offloads on a CPU, where ``offload=`` is refused (the host is the same memory): the plan for
a budget, brought under a lower one by offloading what it keeps, on the tagged host store ``LiveStorages`` leaves
out (``planner.rewrite.offload``)."""

from dataclasses import replace

from planner.memory.offload import MIN_OFFLOAD_BYTES
from planner.memory.simulate import simulate
from planner.options import PlanOptions
from planner.pipeline import plan_from_solution
from planner.plan import Plan
from planner.planning.chunkings import solve_prepared
from planner.planning.offloading import host_link
from planner.planning.prepared import Prepared
from planner.solve.deadline import Deadline
from planner.solve.offload import OffloadLimits, choose_offloads
from planner.solve.result import Solution


def offloaded_plan(prepared: Prepared, plan_fraction: float, *, min_bytes: int = MIN_OFFLOAD_BYTES) -> Plan:
    """The plan for ``plan_fraction`` of the un-checkpointed peak, offloaded down to a lower budget
    (``offloaded_solution``)."""
    return plan_from_solution(*offloaded_solution(prepared, plan_fraction, min_bytes=min_bytes))


def offloaded_solution(prepared: Prepared, plan_fraction: float, *,
                       min_bytes: int = MIN_OFFLOAD_BYTES) -> tuple[Prepared, Solution, int]:
    """The solution for ``plan_fraction`` of the un-checkpointed peak, offloaded down to a lower budget: the lowest
    of a few (a share of what it keeps taken off its peak) that offloads can reach (whichever plan the time-limited
    search returned), with its ``Prepared`` and that budget. ``min_bytes``: the smallest storage offloaded."""
    options = PlanOptions(time_limit_s=4, follow_batch=False)
    limits = OffloadLimits(link=host_link(prepared.profile), min_bytes=min_bytes)  # the CPU's tagged store
    solved, solution = solve_prepared(prepared, int(prepared.baseline.peak_bytes * plan_fraction), options,
                                      Deadline.after(4))
    planned = simulate(solved.memory, solution.plan, solution.saves)
    for share in (0.5, 0.3, 0.15, 0.05):
        budget = planned.peak_bytes - int(planned.breakdown.kept_activations_bytes * share)
        offloads = choose_offloads(solved.memory, solution.plan, solution.saves, budget, limits)
        if offloads is not None and offloads.n:
            return solved, replace(solution, offloads=offloads), budget
    raise AssertionError(f"no offloads bring the plan {solution.plan} under its peak")
