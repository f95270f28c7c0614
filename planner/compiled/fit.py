"""ckplan's plan made to fit a byte budget as ``torch.compile`` runs it: planned, compiled and measured, and planned
again until the compiled step fits.

The eager memory model does not describe the compiled step, in either direction: inductor fuses away what the
eager step allocates between ops (the loss's log-softmax, the norms' intermediates), so the compiled forward holds
less, while the compiled backward of checkpointed regions holds more at once than eager autograd does (measured on
a Qwen2, width 256, 4 layers, 4 x 256 tokens, planned at half its eager peak: eager 64.6 MiB predicted and measured,
compiled 67.9 MiB; its forward ended 7.9 MiB lower and its backward rose 9.0 MiB higher). Neither difference is a
property of one node that a profile could record, so the compiled step is measured, as every probe of
``optimize_compiled`` is: a plan's compiled peak is deterministic (the same plan compiled in three processes
measured the same bytes), so the measurement is the plan's prediction for it.

Plans are solved with the loss counted as inductor runs it (``planner.memory.offset.fused_loss``: no log-softmax
kept for the loss's backward, the logits' size less from its node on), the one difference that is a property of
nodes: where a language model's step peaks at the loss, the eager model saw no room that the compiled step has.
The search is over the budget the plan is solved for (``target``): the compiled peak grows with it, so
each measured plan moves the target by budget / measured peak, twice as far each time a plan measures on the same
side of the budget as the one before (the compiled peak can stay put over several plans: 806.2 MiB for each of 4
plans of a Qwen2 of width 768), inside the interval that the plans measured so far leave (the largest target that
fitted, the smallest that did not), halving it where the move would leave it. It stops at the first plan within
``SLACK`` under the budget, after ``COMPILES`` compilations, or at an over plan with the smallest eager peak, and
returns the fitting plan that re-runs least (by the eager model's re-run time; the larger peak between equals).
When none fits, the placement by hand is tried last (each repeated block checkpointed, as Hugging Face's and
diffusers' own checkpointing do): where the eager step peaks at the loss, which inductor fuses away, the eager
model cannot tell its plans apart below that peak and may keep the blocks' re-runs larger than the compiled step
has room for. When it fits, so may every block but the last, whose activations are the first freed in backward
(``_but_the_last_block``). Then the same search runs
once more with the input embedding compiled apart (``Graphs.INPUTS_APART``: in one graph inductor fuses its
backward into the first layer's, allocating its gradient while that layer's backward buffers are alive: Hugging
Face's own checkpointing on a Qwen2 of width 768 measured 791.1 MiB compiled with a graph per layer, 806.2 in one
graph, 791.1 in one graph with the embedding apart), then with dynamo breaking the graph at each checkpointed
region that mutates state outside it (``Graphs.PER_REGION``, as torch.compile does by default for a Hugging Face
decoder layer).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from planner.capture.inputs import Inputs
from planner.common.loop import TrainingLoop
from planner.common.units import format_bytes
from planner.compiled.backend import INDUCTOR, CompiledModule, Graphs, input_embedding
from planner.compiled.search import Probe, Source, probe
from planner.errors import InfeasibleBudget, OutOfTime, PlannerError
from planner.memory.simulate import simulate
from planner.pipeline import plan_for, plan_from_solution
from planner.plan import Plan
from planner.planning.prepared import Prepared, chunked, for_compiled_loss
from planner.rewrite.executor import HookExecutor
from planner.solve.baselines import every_block

SLACK = 0.02
"""A plan whose compiled peak is within this share under the budget ends the search."""
COMPILES = 6
"""The most plans one search compiles and measures."""
STEP = 0.01
"""The least a measured plan moves the eager target, as a share of it: compiled peaks change in steps of whole
tensors, so a plan a few bytes over moves far enough to change the plan."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Fitted:
    """A plan compiled, with what its compiled step measured."""

    plan: Plan
    module: CompiledModule
    probe: Probe
    target_bytes: int
    """The eager budget it was solved for."""
    compiles: int
    """Plans the search compiled and measured."""
    budget_bytes: int

    @property
    def fits(self) -> bool:
        return self.probe.peak_bytes <= self.budget_bytes


def fit_compiled(prepared: Prepared, budget_bytes: int, example: Inputs,
                 loss_fn: Callable[[Any], torch.Tensor] | None, *, keep_output: bool, compiled_plain_bytes: int,
                 progress: Callable[[str], None] | None = None, compiles: int = COMPILES, backend: str = INDUCTOR,
                 per_region: bool = True, loop: TrainingLoop | None = None) -> Fitted | None:
    """The plan of ``prepared`` whose step compiled (inductor, the whole module) measures the most within
    ``budget_bytes``; when none of the plans tried fits, the one that measured the least (``fits`` False); None
    when there is no eager plan to try.

    ``compiled_plain_bytes``: the un-checkpointed model's compiled peak, which sets the first target (the budget
    scaled by the eager and compiled un-checkpointed peaks: what inductor fuses away, the plan does not need to
    free). ``backend``: the torch.compile backend (``CompiledModule``); ``per_region`` False: the graph is not
    broken at each checkpointed layer (a process-wide setting of dynamo, which a plan compiled by someone else
    does not carry); ``loop``: each plan's step measured as a step of it (``probe``), ``keep_output`` its own."""
    prepared = for_compiled_loss(prepared)  # the loss as inductor runs it: the eager model's largest difference
    eager_plain = prepared.baseline.peak_bytes
    start = min(budget_bytes * eager_plain // max(compiled_plain_bytes, 1), eager_plain - 1)
    tried = _Tried(example, loss_fn, keep_output=keep_output, budget_bytes=budget_bytes, progress=progress,
                   backend=backend, loop=loop)
    for graphs in _ways(prepared, per_region=per_region):
        _search(prepared, start, tried, compiles=tried.compiles + compiles, graphs=graphs)
        if tried.fitted is None:  # the placement by hand: each repeated block, as frameworks' own checkpointing
            with contextlib.suppress(PlannerError):  # a model without repeated blocks
                tried.measure(plan_for(prepared, eager_plain - 1, solver="every_block"), eager_plain - 1,
                              graphs=graphs)
                last = _but_the_last_block(prepared, eager_plain - 1) if tried.fitted is not None else None
                if last is not None:  # every block fits: so may every block but the last
                    tried.measure(last, eager_plain - 1, graphs=graphs)
        if tried.fitted is not None:
            break
    chosen = tried.fitted or tried.least
    return None if chosen is None else replace(chosen, compiles=tried.compiles)


def _but_the_last_block(prepared: Prepared, target: int) -> Plan | None:
    """Each repeated block checkpointed but the last, or None for a model of fewer than two blocks. The last
    block's activations are the first freed in backward, where the compiled step has room the eager model does
    not see: it peaks at the end of backward, as the gradients fill in (a Qwen2 of width 768, 6 layers, 4 x 256:
    every layer but the last measured 791.1 MiB compiled, as every layer does, and stepped +13.0% over the
    un-checkpointed step against every layer's +17.0%)."""
    if prepared.regions.block_count < 2:
        return None
    fine = chunked(prepared, prepared.regions.block_cuts + 1)  # a cut at every block edge
    every = every_block(fine.memory, 0)
    if len(every.plan) != prepared.regions.block_count:  # a block this chunking cannot checkpoint alone
        return None
    plan = every.plan[:-1]
    return plan_from_solution(fine, replace(every, plan=plan, recompute_us=simulate(fine.memory, plan).recompute_us),
                              target)


def _ways(prepared: Prepared, *, per_region: bool) -> list[Graphs]:
    """The ways to break the graph the search tries, in order: one graph; the input embedding apart, where the
    model has one and its plans are run by hooks on a clone of it (a rewritten graph shares the user's modules,
    which must not get the hook); a graph per checkpointed layer."""
    apart = input_embedding(prepared.model) is not None and isinstance(prepared.executor, HookExecutor)
    return [Graphs.ONE, *([Graphs.INPUTS_APART] if apart else []), *([Graphs.PER_REGION] if per_region else [])]


def _search(prepared: Prepared, target: int, tried: _Tried, *, compiles: int, graphs: Graphs) -> None:
    """Moves the eager budget from ``target`` until a plan compiles within ``SLACK`` under the budget, ``tried``
    has ``compiles`` compilations, or an over plan has the smallest eager peak."""
    budget_bytes = tried.budget_bytes
    low, high = 0, prepared.baseline.peak_bytes  # targets known to fit / to be over once compiled
    stride, over = 1, None  # the move doubles while measured plans stay on one side of the budget
    for _ in range(4 * COMPILES):  # plans seen before cost a solve, not a compilation
        for selective in (True, False):  # None: dynamo failed to resume in a region that keeps ops (graph
            plan, lowest = _plan(prepared, target, selective=selective)  # broken): the same budget without them
            if plan is None or (tried.new(plan, graphs) and tried.compiles >= compiles):
                return
            peak = tried.measure(plan, target, graphs=graphs)
            if peak is not None:
                break
        if peak is None:
            return
        stride = 2 * stride if over is (peak > budget_bytes) else 1
        over = peak > budget_bytes
        if peak <= budget_bytes:
            if peak >= budget_bytes * (1 - SLACK):
                return
            low = max(low, target)
        elif lowest:  # no eager plan peaks lower
            return
        else:
            high = min(high, target)
        move = max(abs(target * budget_bytes // peak - target), int(target * STEP))  # a plan's peak moves in steps
        following = target + (move if peak <= budget_bytes else -move) * stride
        if not low < following < high:
            following = (low + high) // 2
        if following in (target, low, high) or high - low <= max(budget_bytes // 1000, 1):
            return
        target = following


class _Tried:
    """The plans a search compiled, each measured once: the fitting one that re-runs least, the one that measured
    the least."""

    def __init__(self, example: Inputs, loss_fn: Callable[[Any], torch.Tensor] | None, *, keep_output: bool,
                 budget_bytes: int, progress: Callable[[str], None] | None, backend: str,
                 loop: TrainingLoop | None) -> None:
        self.example, self.loss_fn, self.keep_output = example, loss_fn, keep_output
        self.backend, self.loop = backend, loop
        self.budget_bytes, self.progress = budget_bytes, progress
        self.measured: dict[Any, tuple[CompiledModule, Probe]] = {}
        self.fitted: Fitted | None = None
        self.least: Fitted | None = None

    @property
    def compiles(self) -> int:
        return len(self.measured)

    def new(self, plan: Plan, graphs: Graphs) -> bool:
        return (_key(plan), graphs) not in self.measured

    def measure(self, plan: Plan, target: int, *, graphs: Graphs) -> int | None:
        """``plan``'s compiled peak (compiled and measured unless measured before); None when dynamo fails to
        compile it with the graph broken (torch 2.13 asserts in the code it resumes after a break in a region
        that keeps ops: ``frozenset not in co_names``)."""
        key = (_key(plan), graphs)
        if key not in self.measured:
            if self.progress is not None:
                self.progress(f"plan for {format_bytes(target)} eager, compile it and measure a step")
            assert plan.module is not None  # plan_for's plans carry their planned module
            # every plan's hooks are the same functions: past dynamo's recompile limit (16 plans) it would leave
            # them eager inside compiled code; the plans compiled before compile again when next called
            torch.compiler.reset()
            try:
                self.measured[key] = probe(plan.module, 1.0, self.example, self.loss_fn,
                                           keep_output=self.keep_output, source=Source.PLAN, graphs=graphs,
                                           backend=self.backend, loop=self.loop)
            except Exception as exc:  # dynamo's own failures, only where ckplan breaks the graph
                if graphs is Graphs.ONE:
                    raise
                if self.progress is not None:
                    self.progress(f"dynamo failed to compile it with the graph broken: {type(exc).__name__}")
                return None
        module, probed = self.measured[key]
        peak = probed.peak_bytes
        if self.progress is not None:
            self.progress(f"{len(plan.segments)} segments{_BROKEN[graphs]}: compiled step "
                          f"{format_bytes(peak)} "
                          f"({'fits' if peak <= self.budget_bytes else 'over'} {format_bytes(self.budget_bytes)})")
        tried = Fitted(plan=plan, module=module, probe=probed, target_bytes=target, compiles=self.compiles,
                       budget_bytes=self.budget_bytes)
        if self.least is None or peak < self.least.probe.peak_bytes:
            self.least = tried
        if peak <= self.budget_bytes and (self.fitted is None or _cheaper(tried, self.fitted)):
            self.fitted = tried
        return peak


_BROKEN = {Graphs.ONE: "", Graphs.INPUTS_APART: ", the input embedding apart", Graphs.PER_REGION: ", graph broken"}


def _cheaper(one: Fitted, other: Fitted) -> bool:
    """Whether ``one`` re-runs less than ``other`` (the eager model's re-run time), or as much at a larger peak."""
    return ((one.plan.recompute_ms, -one.probe.peak_bytes) < (other.plan.recompute_ms, -other.probe.peak_bytes))


def _key(plan: Plan) -> tuple:
    return tuple((segment.nodes, segment.saved_nodes) for segment in plan.segments)


def _plan(prepared: Prepared, target: int, *, selective: bool = True) -> tuple[Plan | None, bool]:
    """The plan for ``target`` eager bytes (``selective`` False: whole segments, no kept ops), and whether it is
    the plan at the smallest eager peak (``target`` is below it, or at it); (None, True) when there is none."""
    try:
        return plan_for(prepared, target, selective=selective), False
    except InfeasibleBudget as exc:
        if exc.min_peak_bytes is None or exc.min_peak_bytes <= target:
            return None, True
        try:
            return plan_for(prepared, exc.min_peak_bytes, selective=selective), True
        except (InfeasibleBudget, OutOfTime):
            return None, True
    except OutOfTime:
        return None, True
