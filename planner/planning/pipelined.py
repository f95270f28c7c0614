"""Plans for one stage of a pipeline-parallel job: the step of one microbatch, solved at a target that leaves room
for the other microbatches its schedule keeps in flight (``planner.memory.pipeline``).

What the other microbatches hold grows with the plan (the activations it keeps), so the target is searched from
the outside, as ``planning/reserve.py`` searches the caching allocator's reserve (``solve_stage``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from planner.common.loop import Gradients
from planner.compat.torch_private import tree_leaves
from planner.distributed.memory import accumulated_grad_bytes
from planner.errors import InfeasibleBudget, OutOfTime
from planner.memory.pipeline import Pipeline, StagePeak, kept_bytes, stage_peak
from planner.memory.simulate import Timeline, simulate
from planner.planning.prepared import Prepared
from planner.solve.result import Solution

TRIES = 8
"""The most targets one stage is solved at."""

Solved = tuple[Prepared, Solution]


def output_bytes(prepared: Prepared) -> int:
    """The stage's output: what the step's end holds beyond parameters, gradients, the inputs and the gradients of
    inputs that require them (a stage after the first: the activations it receives); the profile keeps the output
    (``keep_output``). 0 where unknown."""
    profile = prepared.profile
    if profile.end_bytes is None or not profile.keep_output:
        return 0
    return max(0, profile.end_bytes - profile.param_bytes - profile.grad_bytes - profile.input_bytes
               - _graded_inputs(prepared))


def _graded_inputs(prepared: Prepared) -> int:
    """Bytes of the step's inputs that require gradients (a stage after the first: the activations it receives)."""
    return sum(t.untyped_storage().nbytes() for t in tree_leaves((prepared.example.args, prepared.example.kwargs))
               if isinstance(t, torch.Tensor) and t.requires_grad)


def unplanned_stage_peak(prepared: Prepared, pipeline: Pipeline, rank: int) -> int:
    """The stage's peak without checkpointing: what ``"NN%"`` budgets of a pipeline stage are of."""
    return _stage(prepared, prepared.baseline, kept_bytes(prepared.memory, ()), pipeline, rank)[0]


def held_by_stage(prepared: Prepared, pair: Solved, pipeline: Pipeline, rank: int, baseline_bytes: int) -> StagePeak:
    """The stage's peak under the solution ``pair`` (``planner.memory.pipeline``, ``_stage``)."""
    solved, solution = pair
    timeline = simulate(solved.memory, solution.plan, solution.saves, solution.offloads)
    kept = kept_bytes(solved.memory, solution.plan, solution.saves)
    peak, per, buffers = _stage(prepared, timeline, kept, pipeline, rank)
    return StagePeak(rank=rank, in_flight=pipeline.in_flight(rank), per_microbatch_bytes=per, buffers_bytes=buffers,
                     peak_bytes=peak, baseline_peak_bytes=baseline_bytes)


def _stage(prepared: Prepared, timeline: Timeline, kept: int, pipeline: Pipeline, rank: int) -> tuple[int, int, int]:
    """The stage's peak, what each other microbatch in flight holds, and what torch.distributed.pipelining's runtime
    holds for the step's other microbatches whatever the plan, for one microbatch's step ``timeline`` keeping
    ``kept`` bytes for its backward.

    The runtime's: the first stage's inputs are the whole batch, split into microbatches up front; every other stage
    receives each microbatch's input into a buffer of its own, and every stage but the last each microbatch's output
    gradient, all allocated once for the step's microbatches (the profiled step counts one input and no output
    gradient: its stand-in loss, the sum of the outputs, has none); the last stage keeps every microbatch's output
    until the step ends, to return them merged (``output_chunks``), unless the loop drops them (``keep_output=False``:
    ``step(..., return_outputs=False)``); every stage holds each microbatch's output until its backward
    (``fwd_cache``: the profiled step keeps its output); a stage after the first sends each input gradient
    back asynchronously and holds it until the send completes, which the schedule waits for at its next exchange. A
    stage before the last keeps an output until its gradient comes back: in each microbatch in flight."""
    m, output = pipeline.microbatches, output_bytes(prepared)
    last = rank == pipeline.stages - 1
    returned = (m - 1) * output if prepared.options.keep_output else 0  # the last stage's outputs, returned merged
    buffers = (m - 1) * prepared.profile.input_bytes + (returned if last else m * output) \
        + _graded_inputs(prepared)  # the last input gradient sent back, held until its send completes
    per = kept + (0 if last else output)
    later = stage_peak(_with_gradients(prepared, timeline), pipeline.in_flight_after_first_backward(rank), per)
    return max(stage_peak(timeline.peak_bytes, pipeline.in_flight(rank), per), later) + buffers, per, buffers


def _with_gradients(prepared: Prepared, timeline: Timeline) -> int:
    """The step's peak with the gradients of earlier microbatches alive throughout, backward adding into them in
    place (as ``planner.memory.offset`` counts accumulation): the whole gradients at every forward node, at each
    backward node those the profiled step had not made yet. A loop that accumulates already counts them. On the
    ranks of an FSDP job, the un-sharded gradients each unit accumulates (``accumulated_grad_bytes``: in the
    reduce dtype); the profiled step makes its own in the compute dtype."""
    if prepared.loop.gradients is Gradients.THROUGHOUT:
        return timeline.peak_bytes
    profile, dist = prepared.profile, prepared.distributed
    whole = accumulated_grad_bytes(dist) if dist is not None and dist.parallel == "fsdp" else profile.grad_bytes
    made = np.array([node.bwd_grad_bytes or 0 for node in profile.nodes], dtype=np.int64)
    forward = timeline.fwd_bytes + whole
    backward = np.where(timeline.bwd_bytes >= 0, timeline.bwd_bytes + whole - made, -1)
    return int(max(forward.max(initial=0), backward.max(initial=0)))


def solve_stage(prepared: Prepared, budget_bytes: int, pipeline: Pipeline, rank: int, baseline_bytes: int,
                solved: Callable[[int], Solved]) -> tuple[Solved, StagePeak]:
    """The least re-run solution whose stage peak fits ``budget_bytes`` (``solved(target)`` solves one
    microbatch's step at a target), and that peak.

    ``baseline_bytes``: the stage's un-checkpointed peak (``unplanned_stage_peak``), which the returned peak
    carries. The first target is the budget; an over one moves down by its excess shared among the microbatches in
    flight (a byte the step no longer keeps is one fewer in each), twice as far each time the plan is still over, not
    below the least step any plan reaches; once a target fits and one is over, halfway between them; at most
    ``TRIES`` solves. Of the fitting ones, the one that re-runs least.

    Raises:
        InfeasibleBudget: no target tried gives a stage peak within the budget; carries the smallest found."""
    fitting: list[tuple[Solved, StagePeak]] = []
    smallest: int | None = None
    target, stride = budget_bytes, 1  # the move doubles while the plans stay over (they change in whole tensors)
    low, high, floor = 0, None, 0  # targets known to fit, to be over; the least step any plan reaches
    for _ in range(TRIES):
        try:
            pair = solved(target)
        except OutOfTime:  # the solves share time_limit_s: the best so far, if any fits
            if fitting:
                break
            raise
        except InfeasibleBudget as exc:  # below every plan's step: the least step any plan reaches next
            if exc.min_peak_bytes is None or exc.min_peak_bytes <= target or floor:
                break
            target = floor = exc.min_peak_bytes
            continue
        peak = held_by_stage(prepared, pair, pipeline, rank, baseline_bytes)
        smallest = peak.peak_bytes if smallest is None else min(smallest, peak.peak_bytes)
        if peak.peak_bytes <= budget_bytes:
            fitting.append((pair, peak))
            low = target
            if high is None:
                break
            following = (low + high) // 2
        else:
            high = target
            move = max((peak.peak_bytes - budget_bytes) // peak.in_flight, 1) * stride
            stride *= 2
            following = (low + high) // 2 if low else \
                max(min(target - move, prepared.baseline.peak_bytes - 1), floor)  # above it every target plans nothing
        if following in (target, low, high) or following <= 0 or high - low <= budget_bytes // 1000:
            break
        target = following
    if fitting:
        return min(fitting, key=lambda found: found[0][1].recompute_us)
    raise InfeasibleBudget(budget_bytes, smallest, reason=f"counted as pipeline stage {rank} of {pipeline.stages} "
                           f"holds it ({pipeline.in_flight(rank)} microbatches in flight under "
                           f"{pipeline.schedule.value})")
