"""The plan for a budget when activations may also go to host memory: keep, re-run or offload.

The checkpointing strategies plan for the device budget and for a few budgets between it and the
un-checkpointed peak (``RUNGS``); each plan above the budget is brought under it by offloading kept
activations (``planner.solve.offload.choose_offloads``), and the plan whose re-runs and exposed copies cost
the least wins. All of it shares the solve stage's ``Deadline``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace

from planner.errors import InfeasibleBudget, OptionError, OutOfTime
from planner.memory.model import MemoryModel
from planner.memory.offload import MIN_OFFLOAD_BYTES, Host, HostLink, Offloads, offloaded_bytes
from planner.options import PlanOptions
from planner.planning.prepared import Prepared
from planner.profiling.devices import spec_for
from planner.profiling.headroom import host_memory_bytes
from planner.profiling.record import Profile
from planner.rewrite.offload_spec import OffloadSpec, targets_of
from planner.solve.deadline import Deadline
from planner.solve.offload import OffloadLimits, choose_offloads
from planner.solve.result import Solution, SolverStatus

RUNGS = 6
"""Budgets above the device's that are planned and then offloaded down to it (``rungs_above``); when
checkpointing alone cannot fit, the smallest peak it reaches comes first. Rungs are planned with op-level saves
where the options allow them: an op output a segment caches is offloaded as well as one the hooks see."""
BISECT = 2
"""Budgets tried between the last rung offloads bring down to the budget and the first they cannot."""
FIRST_SHARE = 0.4
"""Share of the time limit the plan at the device budget itself gets; the rungs share the rest."""

SolveAt = Callable[[int, Deadline, bool], tuple[Prepared, Solution]]
"""Plans a budget in bytes before a deadline, with op-level saves or without (``plan_for``'s strategy, FSDP's unit
split included)."""
Choose = Callable[[Prepared, Solution, int, OffloadLimits], Offloads | None]
"""The offloads that bring a solution (planned on its ``Prepared``) under a budget, or None when none do."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Ladder:
    """The rungs ``solve_offloaded`` climbs and how it brings each down: for one training step, the step's peak
    (``for_step``); for a pipeline stage, the stage's (``planner.planning.pipelined.stage_ladder``)."""

    top_bytes: int
    """The peak without checkpointing, where the rungs end."""
    copies: int = 1
    """How many copies of a plan's offloads are off the device at once (a stage's microbatches in flight)."""
    choose: Choose
    bounded: bool = True
    """Whether ``_offload_bound`` holds: the solves at each budget are the step's own (a stage's search proves
    nothing)."""
    rungs: int = RUNGS
    """How many budgets above are planned (``rungs_above``)."""
    first_share: float = FIRST_SHARE
    """Share of the time the plan at the budget itself gets."""

    @classmethod
    def for_step(cls, prepared: Prepared) -> Ladder:
        return cls(top_bytes=prepared.baseline.peak_bytes, choose=lambda on, solution, budget, limits: choose_offloads(
            on.memory, solution.plan, solution.saves, budget, limits))


def rungs_above(budget_bytes: int, top_bytes: int, limits: OffloadLimits, memory: MemoryModel,
                copies: int = 1, count: int = RUNGS) -> list[int]:
    """The budgets above ``budget_bytes`` worth planning and offloading down to it: ``count`` of them, closer
    together near the budget (with 6: 1/32 of the way to the un-checkpointed peak ``top_bytes``, then 1/16, ... 1),
    and none further than offloads can take off the device (``carried_bytes``, for each of ``copies``)."""
    reach = min(top_bytes, budget_bytes + copies * carried_bytes(limits, memory, top_bytes - budget_bytes))
    rungs = sorted({budget_bytes + (reach - budget_bytes) // 2 ** (count - 1 - i) for i in range(count)})
    return [r for r in rungs if r > budget_bytes]


def carried_bytes(limits: OffloadLimits, memory: MemoryModel, most: int) -> int:
    """The most bytes any choice of offloads keeps off the device at once (at most ``most``): what the link carries
    out while the forward computes, on a link that overlaps compute (a copy that would end after the forward is
    not made), and what the host budget holds."""
    carried = most
    if limits.link.overlaps:
        carried = min(carried, int(limits.link.d2h_bytes_per_us * int(memory.node_cost_us.sum())))
    if limits.host_budget_bytes is not None:
        carried = min(carried, limits.host_budget_bytes)
    return carried


def host_link(profile: Profile) -> HostLink | None:
    """The host link offloaded activations cross, from the profile: its measured copies (the device spec's for an
    estimate). Copies overlap compute everywhere but on a CPU, where the host store is the same memory and every
    copy is synchronous. None when the profile does not know the link."""
    if profile.d2h_gb_per_s is None or profile.h2d_gb_per_s is None:
        return None
    source = (f"device spec {profile.estimated_for}" if profile.estimated_for
              else f"measured on {profile.device} when profiled")
    return HostLink.from_gb_per_s(profile.d2h_gb_per_s, profile.h2d_gb_per_s,
                                  overlaps=not profile.device.startswith("cpu"), source=source)


def offload_limits(prepared: Prepared, options: PlanOptions) -> OffloadLimits | None:
    """What bounds the plan's offloads, or None when it offloads nothing (``PlanOptions.offload``).

    Raises:
        OptionError: ``offload=True`` where the profile does not know the host link, or on a CPU.
    """
    if options.offload is False:
        return None
    link = host_link(prepared.profile)
    if options.offload is None:
        if link is None or not link.overlaps:
            return None
    elif link is None:
        raise OptionError("offload needs the host link's copy rates, which this profile lacks (a profile saved "
                          "without them, or a device spec without device_to_host_gb_per_s): profile again, or add "
                          "them to the spec (docs/profiles.md)")
    elif not link.overlaps:
        raise OptionError(f"offload moves activations from the device to host memory, and on "
                          f"{prepared.profile.device} they are the same memory: nothing would be freed; plan for "
                          "the GPU it trains on (on it, or device='h100')")
    host = host_of(prepared, options)
    budget = options.host_budget
    return OffloadLimits(link=host.link(link), min_bytes=MIN_OFFLOAD_BYTES,
                         host_budget_bytes=budget if isinstance(budget, int) else host.budget_bytes)


def host_of(prepared: Prepared, options: PlanOptions) -> Host:
    """The host the plan's offloads go to, as the ranks on it share it (``PlanOptions.ranks_per_host``): for a
    device spec, its host figures, shared by the job's ranks up to the spec's ``gpus_per_host``; on a GPU profiled
    here, this machine's memory (its bandwidth unknown: the link was measured), shared by torchrun's local ranks."""
    spec = spec_for(prepared.profile, options.device)
    if spec is not None:
        ranks = options.ranks_per_host or (min(options.world_size * options.tensor_parallel, spec.gpus_per_host)
                                           if spec.gpus_per_host is not None else 1)
        return Host(ranks=ranks, memory_bytes=spec.host_memory_bytes,
                    bandwidth_gb_per_s=spec.host_memory_bandwidth_gb_per_s, source=spec.host_source or "")
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    ranks = options.ranks_per_host or (int(local) if local.isdigit() and int(local) > 0 else 1)
    here = options.profile is None and not prepared.profile.device.startswith("cpu")
    return Host(ranks=ranks, memory_bytes=host_memory_bytes() if here else None, bandwidth_gb_per_s=None,
                source="this machine's memory" if here else "")


def solve_offloaded(prepared: Prepared, budget_bytes: int, limits: OffloadLimits, deadline: Deadline,
                    solve_at: SolveAt, ladder: Ladder | None = None) -> tuple[Prepared, Solution]:
    """The cheapest of: the plan for ``budget_bytes`` itself, and the plans for each rung above it offloaded
    down to it (``ladder``: default the step's, ``Ladder.for_step``). At the first rung offloads cannot bring down
    (those above keep more), the budgets between it and the rung below are bisected ``BISECT`` times. A plan with
    offloads is ``FEASIBLE`` (its re-runs are optimal for the rung's budget only).

    Raises:
        InfeasibleBudget / OutOfTime: as the plain solve, when no plan fits even with offloads.
    """
    ladder = ladder or Ladder.for_step(prepared)
    best: tuple[int, Prepared, Solution] | None = None
    failure: InfeasibleBudget | OutOfTime | None = None
    solved: dict[int, Solution] = {}  # by budget, the rungs planned
    try:
        plain, solution = solve_at(budget_bytes, deadline.within(deadline.left_s() * ladder.first_share), True)
        best = (solution.recompute_us, plain, solution)
    except (InfeasibleBudget, OutOfTime) as exc:
        failure = exc
    rungs = rungs_above(budget_bytes, ladder.top_bytes, limits, prepared.memory, ladder.copies, ladder.rungs)
    floor = getattr(failure, "min_peak_bytes", None)
    if floor is not None and budget_bytes < floor < (rungs[0] if rungs else floor + 1):
        rungs.insert(0, floor)  # the smallest peak checkpointing reaches, offloaded down to the budget

    def attempt(higher: int, share: int) -> bool:
        """Plans ``higher``, offloads it down to the budget, keeps it if it is the cheapest; False when offloads
        cannot bring it down."""
        nonlocal best
        try:
            rung_prepared, solution = solve_at(higher, deadline.within(deadline.left_s() / share), True)
        except (InfeasibleBudget, OutOfTime):
            return True
        solved[higher] = solution
        if best is not None and solution.recompute_us >= best[0]:
            return True  # re-runs as much as the best plan so far: offloads cannot make it cheaper
        offloads = ladder.choose(rung_prepared, solution, budget_bytes, limits)
        if offloads is None:
            return False
        cost = solution.recompute_us + offloads.exposed_us
        if offloads.n and (best is None or cost < best[0]):
            best = (cost, rung_prepared, replace(solution, offloads=offloads, status=SolverStatus.FEASIBLE,
                                                 bound_us=None))
        return True

    below = budget_bytes
    for i, higher in enumerate(rungs):
        if deadline.passed or (best is not None and best[2].interrupted) or higher <= budget_bytes:
            break
        if attempt(higher, len(rungs) - i + BISECT):
            below = higher
            continue
        for k in range(BISECT):  # the rungs above keep more: offloads will not bring them down either
            middle = (below + higher) // 2
            if deadline.passed or middle <= below:
                break
            if attempt(middle, BISECT - k):
                below = middle
            else:
                higher = middle
        break
    if best is None:
        assert failure is not None
        raise failure
    if best[2].offloads.n and ladder.bounded:
        best = (best[0], best[1], replace(best[2], bound_us=_offload_bound(prepared, budget_bytes, limits, deadline,
                                                                           solve_at, solved)))
    return best[1], best[2]


def _offload_bound(prepared: Prepared, budget_bytes: int, limits: OffloadLimits, deadline: Deadline,
                   solve_at: SolveAt, solved: dict[int, Solution]) -> int | None:
    """A proven lower bound on the re-run time of any plan that fits ``budget_bytes`` with offloads (and so on its
    re-runs plus exposed copies), among the plans of this chunking; None when nothing is proven.

    Whatever a plan offloads, it keeps at most ``carried_bytes`` off the device at once, so without its offloads
    the same plan peaks at most that much higher: it is a plan for ``budget_bytes + carried_bytes`` without
    offloads, and re-runs at least what the solver proves every such plan does (0 when that budget reaches the
    un-checkpointed peak). That budget is the top rung, often planned already."""
    top = prepared.baseline.peak_bytes
    higher = budget_bytes + carried_bytes(limits, prepared.memory, top - budget_bytes)
    if higher >= top:
        return 0
    solution = solved.get(higher)
    if solution is None and not deadline.passed:
        try:
            _, solution = solve_at(higher, deadline.within(deadline.left_s()), True)
        except (InfeasibleBudget, OutOfTime):
            return None
    return None if solution is None or solution.interrupted else solution.bound_us


def offload_spec(prepared: Prepared, offloads: Offloads) -> OffloadSpec | None:
    """What the executor needs to run ``offloads`` (each storage found by the op that makes it), with what the
    model predicts of them; None when the plan offloads nothing."""
    if not offloads.n:
        return None
    memory, nodes = prepared.memory, prepared.profile.nodes
    return OffloadSpec(
        targets=targets_of([nd.kernels for nd in nodes], [int(memory.producer[s]) for s in offloads.storages],
                           [int(memory.size[s]) for s in offloads.storages], offloads.group,
                           [prepared.profile.storages[s].op for s in offloads.storages], offloads.cached,
                           [prepared.profile.storages[s].output for s in offloads.storages]),
        storages=offloads.n, offloaded_bytes=offloaded_bytes(memory, offloads), exposed_ms=offloads.exposed_us / 1000,
        d2h_busy_ms=offloads.d2h_busy_us / 1000, forward_ms=offloads.fwd_us / 1000,
        h2d_busy_ms=offloads.h2d_busy_us / 1000, backward_ms=offloads.bwd_us / 1000,
        link=offloads.link)
