"""Plans with offloads chosen by hand, where ``offload=`` would refuse or choose otherwise: on a CPU (the host is
the same memory; the executor copies to the tagged host store ``LiveStorages`` leaves out, ``planner.rewrite.offload``)
for the tests, and on a GPU for ``bench/gpu_check.py``: a plan brought under a lower budget by offloading what it
keeps, and a plan whose segments cache op outputs that are all offloaded."""

from dataclasses import replace

from planner.memory.offload import MIN_OFFLOAD_BYTES, HostLink, candidates, holding, schedule
from planner.memory.saves import check_saves, partner, segment_of
from planner.memory.simulate import simulate
from planner.options import PlanOptions
from planner.pipeline import plan_from_solution
from planner.plan import Plan
from planner.planning.chunkings import save_options_for, solve_prepared
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


def cached_offloaded_plan(prepared: Prepared, plan_fraction: float, keep: tuple[str, ...], *,
                          link: HostLink | None = None) -> Plan:
    """The whole-segment plan for ``plan_fraction`` of the un-checkpointed peak with the ops ``keep`` names kept in
    its segments (selective checkpointing's cache), its cached outputs offloaded over ``link`` (default the
    profile's), at the peak that predicts: all of them, or the earliest made, as many as the forward has time to
    copy out."""
    solved, solution = solve_prepared(prepared, int(prepared.baseline.peak_bytes * plan_fraction),
                                      PlanOptions(time_limit_s=4, follow_batch=False, selective=False),
                                      Deadline.after(4))
    memory = solved.memory
    inside = segment_of(memory, solution.plan)
    saves = frozenset(o for o in save_options_for(solved, PlanOptions(must_save=keep)).must_save
                      if inside[o] >= 0 and inside[partner(memory, o)] == inside[o])
    check_saves(memory, solution.plan, saves)
    held = holding(memory, solution.plan, saves)
    cached = sorted((int(s) for s in candidates(memory, solution.plan, saves, held=held) if held.cached[s]),
                    key=lambda s: int(held.pack[s]))
    assert cached, f"the plan {solution.plan} caches nothing offloadable (saves {sorted(saves)})"
    link = link or host_link(prepared.profile)
    assert link is not None, "the profile does not know the host link"
    while (offloads := schedule(memory, solution.plan, saves, cached, link, held)) is None and len(cached) > 1:
        cached.pop()  # the copy of the last one made cannot finish before the forward ends
    assert offloads is not None and all(offloads.cached)
    peak = simulate(memory, solution.plan, saves, offloads).peak_bytes
    assert peak < simulate(memory, solution.plan, saves).peak_bytes
    return plan_from_solution(solved, replace(solution, saves=saves, offloads=offloads), peak)
