"""``optimize_compiled``: the fastest ``torch.compile`` partition whose measured peak fits a byte budget."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from torch import nn
from typing_extensions import Unpack

from planner.capture.inputs import as_inputs
from planner.common.budget import check_budget, is_device_budget, parse_budget
from planner.common.units import format_bytes
from planner.compiled.backend import CompiledModule, Graphs
from planner.compiled.fit import fit_compiled
from planner.compiled.search import FRACTIONS, Probe, Source, probe_all, timed
from planner.errors import InfeasibleBudget, OptionError
from planner.options import OptionArgs, PlanOptions, resolve
from planner.pipeline import UserInputs, prepare
from planner.plan import Plan
from planner.profiling.fitting import resident_bytes
from planner.profiling.headroom import capacity_bytes


@dataclass(frozen=True, kw_only=True)
class CompiledPlan:
    """The chosen partition and what every probe measured."""

    module: CompiledModule
    """The model (or ``plan.module``) compiled as ``probes[chosen]``; shares the model's parameters and buffers."""
    plan: Plan | None
    """The eager plan compiled, when ``source`` is ``Source.PLAN``."""
    budget_bytes: int
    probes: tuple[Probe, ...]
    """Every probe, fraction 1.0 first (compile's own partition: what ``"NN%"`` is of, and the timing
    baseline, timed beside the others whether or not it fits)."""
    chosen: int
    """Index of the chosen probe."""

    @property
    def source(self) -> Source:
        return self.probes[self.chosen].source

    @property
    def fraction(self) -> float:
        """The ``activation_memory_budget`` it was compiled with."""
        return self.probes[self.chosen].fraction

    @property
    def peak_bytes(self) -> int:
        """Its measured peak (one training step)."""
        return self.probes[self.chosen].peak_bytes

    @property
    def step_ms(self) -> float:
        return _ms(self.probes[self.chosen])

    @property
    def baseline_peak_bytes(self) -> int:
        return self.probes[0].peak_bytes

    @property
    def baseline_step_ms(self) -> float:
        return _ms(self.probes[0])

    @property
    def overhead(self) -> float:
        """Step time over fraction 1.0's, minus 1 (negative: faster)."""
        return self.step_ms / self.baseline_step_ms - 1

    def summary(self) -> str:
        what = ("ckplan's plan compiled" if self.source is Source.PLAN
                else f"torch.compile at activation_memory_budget={self.fraction:g}")
        graphs = self.probes[self.chosen].graphs
        if graphs is Graphs.PER_REGION:
            what += " (the graph broken at its checkpointed layers, as torch.compile does by default)"
        elif graphs is Graphs.INPUTS_APART:
            what += " (the input embedding compiled apart: one graph break after it)"
        return (f"{what}: peak {format_bytes(self.peak_bytes)} "
                f"measured (budget {format_bytes(self.budget_bytes)}, "
                f"{format_bytes(self.baseline_peak_bytes)} at 1.0), "
                f"step {self.step_ms:.1f} ms ({self.overhead:+.1%} vs 1.0)")


def optimize_compiled(model: nn.Module, budget: int | str, *, inputs: UserInputs = None,
                      options: PlanOptions | None = None, fractions: Sequence[float] = FRACTIONS, runs: int = 3,
                      eager_plan: bool = True, **overrides: Unpack[OptionArgs]) -> CompiledPlan:
    """Compiles ``model`` so that one training step's measured peak fits ``budget``, as fast as it can.

    torch.compile's ``activation_memory_budget`` bounds saved bytes as a fraction, not the peak, and
    the peak it gives is not monotonic in the fraction. This compiles the model at each of
    ``fractions`` (1.0 always first), measures each step's peak, times the ones that fit against each
    other (interleaved, median of ``runs``) and returns the fastest. Those within ``CLOSE`` (3%) of the
    fastest are timed again with ``RETIME`` (3) times the steps; within ``TIE`` (1%) of each other the
    smaller peak wins. Each probe is a compilation, so
    this takes a compile per fraction (about 20 s each for a small transformer on a CPU).

    The knapsack re-runs op by op and fuses what it re-runs, but its low fractions re-run so much at
    once that their peak can exceed the un-checkpointed one. With ``eager_plan`` ckplan's own plan for
    the budget (``optimize``: segments re-run one at a time) is compiled and measured too; it reaches
    budgets no fraction does. The eager memory model does not describe the compiled step, so the plan is
    compiled and measured, and planned again at another eager budget until its compiled step fits within
    ``SLACK`` (2%) under the budget, at most ``COMPILES`` (6) compilations, then every repeated block
    checkpointed, then the same with the input embedding compiled apart, then with the graph broken at each
    checkpointed layer (``planner.compiled.fit``).

    Args:
        budget: bytes, ``"4GB"``-style, or ``"60%"`` of the peak compiled at fraction 1.0.
        fractions: the fractions to probe, each in [0, 1].
        options, **overrides: the ``PlanOptions`` of ``optimize`` (``loss_fn``, ``keep_output``, ``progress``,
            and what ckplan's own eager plan is solved with); ``device``, ``world_size`` and ``profile`` do not
            apply: every partition is compiled and measured here.

    Raises:
        InfeasibleBudget: no probe fits; carries the smallest measured peak.
        BudgetError, OptionError, InputError: a malformed budget, a fraction out of [0, 1], no inputs.
    """
    opts = resolve(options, overrides, where="optimize_compiled")
    loss_fn, keep_output, progress = opts.loss_fn, opts.keep_output, opts.progress
    check_budget(budget)
    bad = [f for f in fractions if not 0.0 <= f <= 1.0]
    if bad or not fractions:
        raise OptionError(f"fractions {list(fractions)!r} must be a non-empty list of numbers in [0, 1] "
                          f"(activation_memory_budget); got {bad[0] if bad else 'none'}")
    if runs < 1:
        raise OptionError(f"runs={runs!r}: the steps timed per fitting probe must be at least 1")
    example = as_inputs(model, inputs)
    order = [1.0, *dict.fromkeys(f for f in fractions if f != 1.0)]
    probed = probe_all(model, order, example, loss_fn, keep_output=keep_output, progress=progress)
    device = next(model.parameters()).device
    budget_bytes = parse_budget(budget, baseline_peak_bytes=probed[0][1].peak_bytes,
                                device_bytes=capacity_bytes(device, held_bytes=resident_bytes(model, example))
                                if is_device_budget(budget) else None)
    plans: dict[int, Plan] = {}
    if eager_plan:
        if progress is not None:
            progress("capture and profile the eager step")
        prepared = prepare(model, inputs=inputs, options=replace(opts, progress=None, compilable=True))
        fitted = fit_compiled(prepared, budget_bytes, example, loss_fn, keep_output=keep_output,
                              compiled_plain_bytes=probed[0][1].peak_bytes, progress=progress)
        if fitted is not None:  # measured, fitting or not: an over plan is the smallest peak only when none fits
            plans[len(probed)] = fitted.plan
            probed.append((fitted.module, fitted.probe))
    fitting = [i for i, (_, p) in enumerate(probed) if p.peak_bytes <= budget_bytes]
    if not fitting:
        smallest = min(p.peak_bytes for _, p in probed)
        raise InfeasibleBudget(budget_bytes, smallest, reason=f"torch.compile at activation_memory_budget "
                               f"{', '.join(f'{f:g}' for f in order)}{' and ckplan plans' if eager_plan else ''}")
    if progress is not None:
        progress(f"time {len(fitting)} fitting partitions")
    timing = sorted({0, *fitting})
    times = dict(zip(timing, timed([probed[i] for i in timing], example, loss_fn, runs=runs)))
    close = finalists(fitting, times)
    if len(close) > 1:  # a few steps cannot rank them: more steps, the 1.0 baseline timed beside them
        timing = sorted({0, *close})
        times |= dict(zip(timing, timed([probed[i] for i in timing], example, loss_fn, runs=RETIME * runs)))
    best = choose(close, times)
    return CompiledPlan(module=probed[best][0], plan=plans.get(best), budget_bytes=budget_bytes,
                        probes=tuple(times.get(i, p) for i, (_, p) in enumerate(probed)), chosen=best)


CLOSE = 0.03
"""Fitting probes within this share of the fastest median are timed again, ``RETIME`` times as long."""
RETIME = 3
TIE = 0.01
"""After re-timing, probes within this share of the fastest are a tie: the smaller peak wins."""


def finalists(fitting: Sequence[int], times: Mapping[int, Probe]) -> list[int]:
    """The fitting probes whose median step is within ``CLOSE`` of the fastest."""
    fastest = min(_ms(times[i]) for i in fitting)
    return [i for i in fitting if _ms(times[i]) <= fastest * (1 + CLOSE)]


def choose(candidates: Sequence[int], times: Mapping[int, Probe]) -> int:
    """The fastest candidate; among those within ``TIE`` of it, the one with the smallest peak (then the
    fastest): a partition no faster by more than noise should not cost memory headroom."""
    fastest = min(_ms(times[i]) for i in candidates)
    tied = [i for i in candidates if _ms(times[i]) <= fastest * (1 + TIE)]
    return min(tied, key=lambda i: (times[i].peak_bytes, times[i].step_ms))


def _ms(measured: Probe) -> float:
    """A timed probe's median step, ms: every fitting probe is timed, and so is the 1.0 baseline."""
    if measured.step_ms is None:
        raise ValueError(f"the probe at activation_memory_budget {measured.fraction:g} was not timed")
    return measured.step_ms
