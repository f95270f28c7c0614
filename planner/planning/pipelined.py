"""Plans for one stage of a pipeline-parallel job: the step of one microbatch, solved so that the stage, with
every microbatch its schedule keeps in flight (``planner.memory.pipeline``), fits the budget.

A stage peaks at one microbatch's step plus what each other microbatch in flight keeps for its backward, which
grows with the plan. Its solves bound both at once (``solve_stage``): the step at a target T, with the
microbatches' gradients accumulating throughout, and what its forward keeps at what the budget leaves the others
beside T, by a constant at the forward's end (``StageRoom``). T is searched from the outside; each plan's stage
peak is then simulated as the runtime holds it (``held_by_stage``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch

from planner.common.loop import Gradients
from planner.compat.torch_private import tree_leaves
from planner.distributed.memory import accumulated_grad_bytes
from planner.errors import InfeasibleBudget, OutOfTime
from planner.memory.model import ChunkPlan
from planner.memory.offload import Offloads, holding, offloaded_bytes
from planner.memory.offset import not_yet_made
from planner.memory.pipeline import Pipeline, StagePeak, kept_bytes, stage_peak
from planner.memory.simulate import Timeline, simulate
from planner.planning.offloading import Ladder, solve_offloaded
from planner.planning.prepared import Prepared, StageRoom, chunked, over_regions
from planner.profiling.memtrack import storage_key
from planner.solve.baselines import hand_placements
from planner.solve.deadline import Deadline
from planner.solve.offload import OffloadLimits, Peak, StepRuler, choose_offloads, relieved
from planner.solve.peaks import min_peak
from planner.solve.result import Solution, SolverStatus

TRIES = 8
"""The most solves one stage gets."""
SCAN = (0.85, 0.6, 0.35, 0.15, 0.0)
"""Where between the least step any plan reaches and the most the budget allows the step target T is tried
first (fractions of that range, highest first); then halfway from the best to its neighbours."""

STAGE_RUNGS = 3
"""Budgets above a stage's own planned and offloaded down (``solve_offloaded``): fewer than a step's, as each is a
search of several solves, not one."""
STAGE_FIRST_SHARE = 0.5
"""Share of the time the stage's plan at its own budget gets when it may offload; the rungs share the rest."""

Solved = tuple[Prepared, Solution]


def output_bytes(prepared: Prepared) -> int:
    """The stage's output: what the step's end holds beyond parameters, gradients, the inputs and the gradients of
    inputs that require them (a stage after the first: the activations it receives); the profile keeps the output
    (``keep_output``). 0 where unknown."""
    profile = prepared.profile
    if profile.end_bytes is None or not profile.keep_output:
        return 0
    return max(0, profile.end_bytes - profile.param_bytes - profile.grad_bytes - _held_inputs(prepared)
               - _graded_inputs(prepared))


def _example_tensors(prepared: Prepared) -> list[torch.Tensor]:
    return [t for t in tree_leaves((prepared.example.args, prepared.example.kwargs)) if isinstance(t, torch.Tensor)]


def _graded_inputs(prepared: Prepared) -> int:
    """Bytes of the step's inputs that require gradients (a stage after the first: the activations it receives)."""
    return sum(t.untyped_storage().nbytes() for t in _example_tensors(prepared) if t.requires_grad)


def _held_inputs(prepared: Prepared) -> int:
    """Bytes the profiled step's inputs held: their whole storages, each once (a microbatch sliced from a batch
    holds the batch's), at least the inputs' own bytes."""
    storages = {storage_key(t): t.untyped_storage().nbytes() for t in _example_tensors(prepared)}
    return max(prepared.profile.input_bytes, sum(storages.values()))


def received_gradient(prepared: Prepared, pipeline: Pipeline, rank: int) -> Prepared:
    """``prepared`` as a stage before the last runs it: its output's gradient arrives dense, in a buffer the runtime
    holds (``_runtime``), where the profiled step's stand-in loss (the sum of the outputs) sent a stride-0 broadcast
    that the first op to read it made dense inside itself (``NodeCost.bwd_expanded_grad_bytes``, counted in its
    ``bwd_hidden_bytes``): those bytes are taken out. The last stage's loss is the loop's own: as profiled."""
    nodes = prepared.profile.nodes
    if rank == pipeline.stages - 1 or not any(node.bwd_expanded_grad_bytes for node in nodes):
        return prepared
    nodes = tuple(replace(node, bwd_hidden_bytes=node.bwd_hidden_bytes - min(max(node.bwd_hidden_bytes, 0),
                                                                            node.bwd_expanded_grad_bytes))
                  for node in nodes)
    return over_regions(replace(prepared, profile=replace(prepared.profile, nodes=nodes)), prepared.regions)


def unplanned_stage_peak(prepared: Prepared, pipeline: Pipeline, rank: int) -> int:
    """The stage's peak without checkpointing: what ``"NN%"`` budgets of a pipeline stage are of."""
    return _stage(prepared, prepared.baseline, kept_bytes(prepared.memory, ()), pipeline, rank)[0]


def held_by_stage(prepared: Prepared, pair: Solved, pipeline: Pipeline, rank: int, baseline_bytes: int) -> StagePeak:
    """The stage's peak under the solution ``pair`` (``planner.memory.pipeline``, ``_stage``): each other microbatch
    in flight holds what its forward kept less what it offloaded, which waits in host memory for its backward."""
    solved, solution = pair
    timeline = simulate(solved.memory, solution.plan, solution.saves, solution.offloads)
    away = offloaded_bytes(solved.memory, solution.offloads)
    kept = kept_bytes(solved.memory, solution.plan, solution.saves) - away
    peak, per, buffers = _stage(prepared, timeline, kept, pipeline, rank)
    return StagePeak(rank=rank, in_flight=pipeline.in_flight(rank), per_microbatch_bytes=per, buffers_bytes=buffers,
                     peak_bytes=peak, baseline_peak_bytes=baseline_bytes,
                     host_bytes=away * pipeline.in_flight(rank))


class StageRuler:
    """A stage's peak under one plan with offloads (``solve.offload.Ruler``): the step's timeline with the
    offloaded storages away where the copies take them, and each other microbatch in flight holding what its
    forward kept less what it offloaded. Past one microbatch in flight every offload lowers the stage's peak."""

    def __init__(self, prepared: Prepared, pair: Solved, pipeline: Pipeline, rank: int) -> None:
        solved, solution = pair
        self.prepared, self.pipeline, self.rank, self.memory = prepared, pipeline, rank, solved.memory
        self.base = simulate(solved.memory, solution.plan, solution.saves)
        self.kept = kept_bytes(solved.memory, solution.plan, solution.saves)
        self.step = StepRuler(solved.memory, self.base, holding(solved.memory, solution.plan, solution.saves))

    def peak(self, offloads: Offloads) -> Peak:
        fwd, bwd = relieved(self.memory, self.base, offloads)
        forward = int(fwd.max(initial=0)) >= int(bwd.max(initial=0))
        timeline = replace(self.base, fwd_bytes=fwd, bwd_bytes=bwd, peak_bytes=max(
            int(fwd.max(initial=0)), int(bwd.max(initial=0)), self.memory.step_bytes))
        kept = self.kept - offloaded_bytes(self.memory, offloads)
        peak = _stage(self.prepared, timeline, kept, self.pipeline, self.rank)[0]
        return ("forward", int(fwd.argmax()), peak) if forward else ("backward", int(bwd.argmax()), peak)

    def lowers(self, s: int, phase: str, node: int) -> bool:
        return self.pipeline.in_flight(self.rank) > 1 or self.step.lowers(s, phase, node)


def stage_ladder(prepared: Prepared, pipeline: Pipeline, rank: int, baseline_bytes: int) -> Ladder:
    """``solve_offloaded``'s rungs for a stage: up to its un-checkpointed peak, each rung's plan offloaded down
    to the budget as the stage holds it (``StageRuler``), its microbatches in flight each holding a copy of its
    offloads in host memory (the host budget shared among them)."""
    k = pipeline.in_flight(rank)

    def choose(on: Prepared, solution: Solution, budget_bytes: int, limits: OffloadLimits) -> Offloads | None:
        host = limits.host_budget_bytes
        share = limits if host is None else replace(limits, host_budget_bytes=host // k)
        return choose_offloads(on.memory, solution.plan, solution.saves, budget_bytes, share,
                               StageRuler(prepared, (on, solution), pipeline, rank))

    return Ladder(top_bytes=baseline_bytes, copies=k, choose=choose, bounded=False, rungs=STAGE_RUNGS,
                  first_share=STAGE_FIRST_SHARE)


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
    buffers, output = _runtime(prepared, pipeline, rank)
    per = kept + output
    later = stage_peak(_with_gradients(prepared, timeline), pipeline.in_flight_after_first_backward(rank), per) \
        + pipeline.sends_held(rank) * output  # a sent output the schedule's send work keeps past its backward
    return max(stage_peak(timeline.peak_bytes, pipeline.in_flight(rank), per), later) + buffers, per, buffers


def _runtime(prepared: Prepared, pipeline: Pipeline, rank: int) -> tuple[int, int]:
    """What the runtime holds for the step's other microbatches (``_stage``), and the output each microbatch in
    flight holds (0 on the last stage)."""
    m, output = pipeline.microbatches, output_bytes(prepared)
    last = rank == pipeline.stages - 1
    returned = (m - 1) * output if prepared.options.keep_output else 0  # the last stage's outputs, returned merged
    inputs = max(0, m * prepared.profile.input_bytes - _held_inputs(prepared))  # those the step does not hold
    buffers = inputs + (returned if last else m * output) \
        + _graded_inputs(prepared)  # the last input gradient sent back, held until its send completes
    return buffers, 0 if last else output


def _with_gradients(prepared: Prepared, timeline: Timeline) -> int:
    """The step's peak with the gradients of earlier microbatches alive throughout, backward adding into them in
    place (as ``planner.memory.offset`` counts accumulation): the whole gradients at every forward node, at each
    backward node those the profiled step had not made yet. A loop that accumulates already counts them. On the
    ranks of an FSDP job, the un-sharded gradients each unit accumulates (``accumulated_grad_bytes``: in the
    reduce dtype); the profiled step makes its own in the compute dtype."""
    if prepared.loop.gradients is Gradients.THROUGHOUT:
        return timeline.peak_bytes
    whole = _accumulated(prepared)
    forward = timeline.fwd_bytes + whole
    backward = np.where(timeline.bwd_bytes >= 0, timeline.bwd_bytes + not_yet_made(prepared.profile, whole), -1)
    return int(max(forward.max(initial=0), backward.max(initial=0)))


def _by_hand(prepared: Prepared) -> list[tuple[Prepared, ChunkPlan]]:
    """The placements people make by hand over the stage's blocks (``baselines.hand_placements``: every block,
    torchtitan's full checkpointing, and ``checkpoint_sequential``'s groups), at a cut per block edge; none when
    the stage has no repeated blocks or that chunking does not cut at their edges."""
    if not prepared.regions.block_count or not prepared.rules.refinable:
        return []
    fine = chunked(prepared, prepared.regions.block_cuts + 1)
    if len(fine.regions.blocks) != prepared.regions.block_count:
        return []
    return [(fine, plan) for plan in hand_placements(fine.memory)]


def _accumulated(prepared: Prepared) -> int:
    """Bytes of the gradients a stage's microbatches accumulate (``_with_gradients``)."""
    dist = prepared.distributed
    return accumulated_grad_bytes(dist) if dist is not None and dist.parallel == "fsdp" else prepared.profile.grad_bytes


def solve_pipelined(prepared: Prepared, budget_bytes: int, pipeline: Pipeline, rank: int, baseline_bytes: int,
                    limits: OffloadLimits | None, solved: Callable[[Prepared, int, Deadline], Solved],
                    deadline: Deadline) -> Solved:
    """The plan for pipeline stage ``rank`` at ``budget_bytes`` (``solve_stage``); where ``limits`` allow offloads,
    the cheapest of it and the plans for budgets above offloaded down to it (``solve_offloaded``, ``stage_ladder``).

    Raises:
        InfeasibleBudget / OutOfTime: as ``solve_stage``, when no plan fits even with offloads."""
    def at(budget: int, within: Deadline, selective: bool = True) -> Solved:
        return solve_stage(prepared, budget, pipeline, rank, baseline_bytes, solved, within)

    if limits is None:
        return at(budget_bytes, deadline)
    return solve_offloaded(prepared, budget_bytes, limits, deadline, at,
                           stage_ladder(prepared, pipeline, rank, baseline_bytes))


def solve_stage(prepared: Prepared, budget_bytes: int, pipeline: Pipeline, rank: int, baseline_bytes: int,
                solved: Callable[[Prepared, int, Deadline], Solved], deadline: Deadline) -> Solved:
    """The least re-run solution whose stage peak fits ``budget_bytes``; ``solved(room, target,
    deadline)`` solves one microbatch's step on the cost model ``room`` at ``target``.

    The step, with the microbatches' gradients accumulating, is solved at a target T; what its forward keeps is
    held to what the budget leaves each other microbatch in flight beside T, by a constant at the forward's end
    (``StageRoom``) that brings the forward's last node to T when the kept bytes reach that share. T is tried at
    ``SCAN``'s points between the least step any plan reaches and the most the budget allows, then halfway from
    the best to its neighbours; each solve gets an equal share of the time left. Each solution's stage peak is
    simulated without the room (``held_by_stage``), so a plan is kept only if the stage really fits. With one
    microbatch in flight, T is the budget less the runtime's buffers, lowered by what is over while it is.

    Raises:
        InfeasibleBudget: no target tried gives a stage peak within the budget; carries the smallest found.
        OutOfTime: the time ran out before any plan fitted."""
    search = _StageSearch(prepared, budget_bytes, pipeline, rank, baseline_bytes, solved, deadline)
    if search.in_flight == 1:
        search.lowered()
    else:
        search.scanned()
    if search.fitting:
        return min(search.fitting, key=lambda found: found[1].recompute_us)
    if deadline.passed and search.smallest is None:
        raise OutOfTime("no plan for the stage was found before the time limit; raise time_limit_s")
    raise InfeasibleBudget(budget_bytes, search.smallest, reason=f"counted as pipeline stage {rank} of "
                           f"{pipeline.stages} holds it ({search.in_flight} microbatch"
                           f"{'es' if search.in_flight > 1 else ''} in flight under "
                           f"{pipeline.schedule.value})")


class _StageSearch:
    """``solve_stage``'s tries: the targets solved, the plans that fit, the smallest stage peak seen."""

    def __init__(self, prepared: Prepared, budget_bytes: int, pipeline: Pipeline, rank: int, baseline_bytes: int,
                 solved: Callable[[Prepared, int, Deadline], Solved], deadline: Deadline) -> None:
        self.prepared, self.budget_bytes, self.pipeline, self.rank = prepared, budget_bytes, pipeline, rank
        self.baseline_bytes, self.solved, self.deadline = baseline_bytes, solved, deadline
        self.in_flight = pipeline.in_flight(rank)
        self.buffers, self.output = _runtime(prepared, pipeline, rank)
        self.whole = _accumulated(prepared)
        self.room = over_regions(replace(prepared, stage=StageRoom(accumulated_bytes=self.whole)), prepared.regions)
        self.top = budget_bytes - self.buffers - (self.in_flight - 1) * self.output  # the step's most
        fwd = self.room.baseline.fwd_bytes
        self.forward_end = int(fwd[-1]) - kept_bytes(self.room.memory, ()) if len(fwd) else 0  # less what it keeps
        self.fitting: list[Solved] = []
        self.plain: dict[int, Prepared] = {}  # id of a chunking's regions -> its cost model without the room
        self.smallest: int | None = None
        self.tried: dict[int, int | None] = {}  # target -> re-run time of its fitting plan (None: none fits)

    def lowered(self) -> None:
        """One microbatch in flight: the step at the most the budget allows, lowered by what is over; where no
        plan fits, the plans of a small step (``least``), for the smallest peak the error reports."""
        target = self.top
        for left in range(TRIES, 0, -1):
            peak = self.attempt(target, left)
            if peak is None or peak.peak_bytes <= self.budget_bytes or self.deadline.passed:
                break
            target -= peak.peak_bytes - self.budget_bytes
        if not self.fitting and not self.deadline.passed:
            self.least()

    def least(self) -> int:
        """The least step peak any plan reaches; that plan and the placements by hand are candidates (where the
        budget is tight, one of them may be the only one that fits)."""
        room = self.room
        smallest_step = min_peak(room.memory, deadline=self.deadline)
        for on, plan in [(room, smallest_step), *_by_hand(room)]:
            self.candidate(Solution(plan=plan, status=SolverStatus.FEASIBLE, bound_us=None, solve_time_s=0.0,
                                    recompute_us=simulate(on.memory, plan).recompute_us), on)
        return int(simulate(room.memory, smallest_step).peak_bytes)

    def scanned(self) -> None:
        """Plans of a small step first (``least``), then the targets at ``SCAN``'s points and halfway from the best
        to its neighbours."""
        least = self.least()
        span = self.top - least
        for i, target in enumerate([least + int(span * x) for x in SCAN] if span > 0 else []):
            self.attempt(target, TRIES - i)
        ranked = sorted((cost, t) for t, cost in self.tried.items() if cost is not None)
        if not ranked:
            return
        best, near = ranked[0][1], sorted(self.tried)
        at = near.index(best)
        for j, neighbour in enumerate((near[at - 1] if at else None, near[at + 1] if at + 1 < len(near) else None)):
            if neighbour is not None and (best + neighbour) // 2 not in self.tried:
                self.attempt((best + neighbour) // 2, 2 - j)

    def attempt(self, target: int, tries_left: int) -> StagePeak | None:
        """The step solved at ``target`` with room for the others (an equal share of the time left among
        ``tries_left``); its stage peak, or None when no plan was found."""
        k = self.in_flight
        share = (self.budget_bytes - self.buffers - target) // (k - 1) - self.output if k > 1 else None
        end = 0 if share is None else max(0, target - share - self.forward_end)
        trial = self.room if not end else over_regions(
            replace(self.room, stage=StageRoom(accumulated_bytes=self.whole, end_bytes=end)), self.room.regions)
        try:
            on, solution = self.solved(trial, target, self.deadline.within(self.deadline.left_s() / max(tries_left, 1)))
        except InfeasibleBudget:
            self.tried[target] = None
            return None
        except OutOfTime:
            if self.fitting or self.deadline.passed:
                self.tried[target] = None
                return None
            raise
        peak = self.candidate(solution, on)
        self.tried[target] = solution.recompute_us if peak.peak_bytes <= self.budget_bytes else None
        return peak

    def candidate(self, solution: Solution, on: Prepared) -> StagePeak:
        """``solution``'s stage peak, without the room; kept if it fits."""
        plain = self.plain.get(id(on.regions))
        if plain is None or plain.regions is not on.regions:
            plain = self.plain[id(on.regions)] = over_regions(replace(on, stage=None), on.regions)
        pair = (plain, solution)
        peak = held_by_stage(self.prepared, pair, self.pipeline, self.rank, self.baseline_bytes)
        self.smallest = peak.peak_bytes if self.smallest is None else min(self.smallest, peak.peak_bytes)
        if peak.peak_bytes <= self.budget_bytes:
            self.fitting.append(pair)
        return peak
