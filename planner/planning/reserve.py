"""What the CUDA caching allocator reserves for a plan's step, and plans whose reserve fits the budget.

A plan's predicted peak counts the bytes its step allocates; on a GPU the caching allocator reserves more (each
request rounded, carved from segments of its own sizes, freed blocks cached), and a step runs out of memory where
it cannot reserve. ``reserved_for`` replays the planned module's step on meta tensors
(``planner.profiling.replay``) and its allocation sequence through the allocator's rules
(``planner.memory.caching``). ``within_reserve`` plans again under a lower target until the plan's reserve fits the
budget, which is what a budget on a GPU bounds by default (``PlanOptions.budget_bounds``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

from torch import nn

from planner.capture.aten import SCALAR_READS_KEY
from planner.common.budget import format_bytes
from planner.errors import InfeasibleBudget, OutOfTime
from planner.memory.caching import ReservedPeak, reserved_peak
from planner.planning.prepared import Prepared
from planner.profiling.headroom import ALLOC_CONF, expandable_segments, is_gpu
from planner.profiling.replay import step_allocations

if TYPE_CHECKING:
    from planner.plan import Plan

TRIES = 4
"""Plans made at lower targets before ``within_reserve`` gives up: each lowers the target by what the last one's
reserve was over the budget."""


def reserve_predicted(prepared: Prepared) -> bool:
    """Whether the reserve of ``prepared``'s plans is predicted: on a GPU, but not for a rank of a distributed job
    (its collectives' buffers are not replayed) nor for a step under autocast (meta tensors, which the replay runs
    on, are not cast by it)."""
    return (is_gpu(prepared.profile.device) and prepared.distributed is None
            and prepared.loop.autocast_dtype is None)


def reserved_for(prepared: Prepared, module: nn.Module, predicted_peak_bytes: int) -> ReservedPeak | None:
    """What the CUDA caching allocator is predicted to reserve for the step of ``module`` (a plan of ``prepared``
    whose predicted peak is ``predicted_peak_bytes``), with this process's ``expandable_segments`` setting; None
    where it is not predicted (``reserve_predicted``) or the replay fails (with a warning saying so)."""
    if not reserve_predicted(prepared):
        return None
    try:
        allocations = step_allocations(module, prepared.example, loss_fn=prepared.options.loss_fn,
                                       keep_output=prepared.profile.keep_output,
                                       reads=prepared.captured.graph_module.meta.get(SCALAR_READS_KEY, []))
    except Exception as exc:  # the prediction is extra: the plan stands without it
        line = (str(exc).splitlines() or [""])[0][:200]
        warnings.warn(f"ckplan: what CUDA's caching allocator reserves for this plan cannot be predicted (its step "
                      f"does not replay on meta tensors: {type(exc).__name__}: {line}); the budget bounds what it "
                      "allocates", stacklevel=3)
        return None
    return reserved_peak(allocations.events, live_peak_bytes=allocations.live_peak_bytes,
                         predicted_peak_bytes=predicted_peak_bytes, expandable=expandable_segments())


def within_reserve(plan: Plan, budget_bytes: int, replan: Callable[[int], Plan]) -> Plan:
    """``plan`` if its reserve fits ``budget_bytes`` (or is not predicted), else the plan ``replan`` makes for a
    target lowered by what the last reserve was over, up to ``TRIES`` times; once one fits, one more plan halfway
    back to the last target that did not, kept if its reserve fits too and it costs less (the target lowered by
    the whole excess can be lower than needed: segments change the reserve in steps).

    Raises:
        InfeasibleBudget: no plan tried has a reserve within the budget; the message says what the closest needs
            and what else lowers it."""
    tried, target, over = [plan], budget_bytes, budget_bytes
    while plan.reserved is not None and plan.reserved.needed_bytes > budget_bytes:
        if len(tried) > TRIES:
            break
        over = target
        target -= plan.reserved.needed_bytes - budget_bytes
        try:
            plan = replan(target)
        except InfeasibleBudget:
            break
        tried.append(plan)
    else:
        return plan if len(tried) == 1 else _cheaper_between(plan, target, over, budget_bytes, replan)
    raise _over(min(tried, key=lambda p: p.reserved.needed_bytes if p.reserved else 0), budget_bytes)


def _cheaper_between(plan: Plan, fits: int, over: int, budget_bytes: int, replan: Callable[[int], Plan]) -> Plan:
    """The plan for the target halfway between ``fits`` (``plan``'s) and ``over`` (whose plan's reserve was over),
    if its reserve fits and it costs less than ``plan``; else ``plan``."""
    try:
        candidate = replan((fits + over) // 2)
    except (InfeasibleBudget, OutOfTime):
        return plan
    fitting = candidate.reserved is None or candidate.reserved.needed_bytes <= budget_bytes
    return candidate if fitting and candidate.predicted_overhead < plan.predicted_overhead else plan


def _over(plan: Plan, budget_bytes: int) -> InfeasibleBudget:
    """The error for a budget no plan's reserve fits, ``plan`` the closest."""
    reserved = plan.reserved
    assert reserved is not None  # only plans with a reserve are over it
    other = "" if reserved.expandable or reserved.other_bytes >= reserved.needed_bytes else \
        f"; {ALLOC_CONF}=expandable_segments:True would need {format_bytes(reserved.other_bytes)}"
    reason = (f"counted as CUDA's caching allocator reserves it, the closest plan needs "
              f"{format_bytes(reserved.needed_bytes)} for {format_bytes(plan.predicted_peak_bytes)} allocated "
              f"(budget_bounds='allocated', ckplan --budget-bounds allocated, bounds what it allocates{other})")
    return InfeasibleBudget(budget_bytes, reserved.needed_bytes, reason=reason)
