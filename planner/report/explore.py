"""Trade-off exploration: one profile, one plan per budget, and what each byte saved costs.

``sweep()`` prepares a model once (capture + profile) and plans it for a list of budgets;
the ``Tradeoff`` it returns holds one row per budget, the hand-made strategies as
reference points, the Pareto front and its knee, a per-block view of what is
checkpointed, and HTML / pandas / matplotlib views for notebooks (plots live in
``planner.report.plotting``).
"""

from __future__ import annotations

import dataclasses
import html
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from typing_extensions import Unpack

from planner.common.budget import check_budget, format_bytes
from planner.errors import InfeasibleBudget, InputError, OptionError
from planner.memory.simulate import simulate
from planner.options import PREPARED, OptionArgs, PlanOptions, resolve
from planner.pipeline import Prepared, UserInputs, plan_for, prepare
from planner.plan import Plan, html_table
from planner.profiling.record import Profile
from planner.report.plotting import plot_blocks, plot_tradeoff
from planner.solve.deadline import Deadline
from planner.solve.registry import SOLVERS, get_solver

REFERENCES = (("none", "none"), ("every block", "every_block"), ("√n", "sqrt_n"))
"""Hand-made strategies shown next to the sweep: (label, name in ``planner.solve.registry.SOLVERS``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TradeoffRow:
    """The plan for one budget of a sweep."""

    budget_bytes: int
    feasible: bool
    """False when no plan fits the budget (then every field below but ``solve_time_s`` is None)."""
    predicted_peak_bytes: int | None
    """Peak of one training step under the plan, from the memory model."""
    predicted_overhead: float | None
    """Recompute time / un-checkpointed step time (0.0 for the empty plan)."""
    n_segments: int | None
    """Number of checkpointed segments."""
    solve_time_s: float
    """Time spent planning this budget, s (for an infeasible budget: proving it)."""
    plan: Plan | None = field(repr=False, compare=False)
    """The plan (with ``module``); a smaller budget's plan when that one is cheaper (see ``sweep``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ReferencePoint:
    """A hand-made strategy evaluated on the same memory model, for comparison."""

    name: str
    """``none``, ``every block`` or ``√n``."""
    predicted_peak_bytes: int
    predicted_overhead: float
    """Recompute time / un-checkpointed step time."""
    n_segments: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Tradeoff:
    """Memory against recompute for one model: the result of ``sweep``.

    The Pareto front is the set of feasible rows no other row beats on both predicted peak
    and overhead. The knee is the front's point farthest from the straight line joining the
    front's two ends, on the origin side, with both axes normalised to [0, 1]: where saving
    memory stops being cheap. It needs three points on the front and a front that bends.
    """

    rows: tuple[TradeoffRow, ...]
    """One per budget, largest budget first."""
    references: tuple[ReferencePoint, ...]
    """``none``, ``every block`` (when the model has numbered blocks) and ``√n``."""
    baseline_peak_bytes: int
    """Predicted peak without checkpointing."""
    step_ms: float
    """Measured time of one un-checkpointed step, ms."""
    min_peak_bytes: int | None
    """Smallest peak any plan reaches, when some budget was infeasible; else None."""
    prepared: Prepared = field(repr=False, compare=False)
    """The captured and profiled model: pass it to ``planner.plan_for`` for more budgets."""

    def front(self) -> tuple[TradeoffRow, ...]:
        """Rows on the Pareto front (distinct points), smallest peak first."""
        feasible = [r for r in self.rows if r.feasible]
        return tuple(feasible[i] for i in pareto_front([_costs(r) for r in feasible]))

    def knee(self) -> TradeoffRow | None:
        """The front's knee (see the class docstring), or None when the front has no bend."""
        front = self.front()
        index = knee_index([_costs(r) for r in front])
        return None if index is None else front[index]

    def blocks_table(self, *, frame: bool = False) -> list[dict[str, Any]] | Any:
        """Which blocks each budget checkpoints: fraction of each block's nodes inside segments.

        Columns are the model's repeated blocks (``blocks.0``...) or, without such blocks,
        its chunks. Rows follow ``rows``; an infeasible budget has None everywhere.

        Args:
            frame: return a pandas DataFrame indexed by ``budget_bytes`` instead of dicts.
        """
        columns = block_columns(self.prepared)
        table = []
        for row in self.rows:
            entry: dict[str, Any] = {"budget_bytes": row.budget_bytes}
            inside = _checkpointed_nodes(self.prepared, row.plan)
            for label, lo, hi in columns:
                entry[label] = None if inside is None else sum(lo <= i < hi for i in inside) / max(1, hi - lo)
            table.append(entry)
        if not frame:
            return table
        return _pandas().DataFrame(table, columns=["budget_bytes", *(c[0] for c in columns)]).set_index("budget_bytes")

    def to_pandas(self) -> Any:
        """The rows as a pandas DataFrame (one column per ``TradeoffRow`` field, ``plan`` included).

        Raises:
            ImportError: pandas is not installed (``pip install pandas`` or ``ckplan[notebook]``).
        """
        names = [f.name for f in dataclasses.fields(TradeoffRow)]
        return _pandas().DataFrame([{n: getattr(r, n) for n in names} for r in self.rows], columns=names)

    def plot(self) -> Any:
        """Predicted peak against overhead: every row, the Pareto front, the knee and the
        reference strategies. Returns a matplotlib Figure."""
        return plot_tradeoff(self)

    def plot_blocks(self) -> Any:
        """Heatmap of ``blocks_table()``: budgets down, blocks across. Returns a matplotlib Figure."""
        return plot_blocks(self)

    def _repr_html_(self) -> str:
        return tradeoff_html(self)


def sweep(model: nn.Module, budgets: Sequence[int | str], *, inputs: UserInputs = None,
          prepared: Prepared | None = None, options: PlanOptions | None = None,
          **overrides: Unpack[OptionArgs]) -> Tradeoff:
    """Plans ``model`` for every budget from one capture and profile.

    Guarantees, checked on the returned rows: a smaller budget never has a smaller predicted
    overhead than a larger one, and every feasible row's predicted peak is within its budget.
    CP-SAT's optimal plans satisfy this by themselves (a plan that fits a budget fits every
    larger one); when the solver stops at its time limit with a worse plan for a larger
    budget (``FEASIBLE``), that row takes the cheaper plan of the smaller budget instead,
    with ``budget_bytes`` set to the row's budget.

    Args:
        model: the model to train (not modified).
        budgets: budgets in any form ``optimize`` takes (bytes, ``"4GB"``, ``"4GiB"``, ``"60%"``).
        inputs: arguments for ``model``, as for ``optimize``; not with ``prepared``.
        prepared: a ``Prepared`` from ``planner.prepare(model, ...)`` to skip capture and profile (also
            accepted as ``profile=``, which otherwise takes a saved ``Profile`` to skip profiling only).
        options, **overrides: the ``PlanOptions`` of ``optimize``; ``time_limit_s`` is per budget.
            ``selective=False`` plans whole segments (~0.2 s per budget on the GPT example, ~7 s with saves).

    Returns:
        A ``Tradeoff`` with one row per budget, largest first; infeasible budgets are rows
        with ``feasible=False``.

    Raises:
        InputError (a TypeError): ``profile`` is neither a ``Prepared`` nor a ``Profile``.
        BudgetError (a ValueError): no budgets, or a malformed budget.
        OptionError (a ValueError): an unknown solver, ``inputs`` or prepare-time options given with ``prepared``,
            or a ``prepared`` of another model.

    Example:
        >>> tradeoff = sweep(model, ["100%", "70%", "50%"], inputs=(x,))   # doctest: +SKIP
        >>> tradeoff.plot().savefig("tradeoff.png")                          # doctest: +SKIP
    """
    if isinstance(overrides.get("profile"), Prepared):  # profile=<Prepared>: the same as prepared=
        prepared = overrides.pop("profile")  # type: ignore[assignment]
    if not budgets:
        raise OptionError("sweep needs at least one budget, e.g. ['100%', '70%', '50%']")
    for budget in budgets:
        check_budget(budget)  # reject a malformed budget before any work
    prepared, opts = _prepared(model, prepared, inputs, options, overrides)
    get_solver(opts.solver)
    rows, min_peak = [], None
    for budget in budgets:
        start = time.perf_counter()
        try:
            plan = plan_for(prepared, budget, options=opts)
        except InfeasibleBudget as exc:
            rows.append(TradeoffRow(budget_bytes=exc.budget_bytes, feasible=False, predicted_peak_bytes=None,
                                    predicted_overhead=None, n_segments=None,
                                    solve_time_s=time.perf_counter() - start, plan=None))
            min_peak = min((p for p in (min_peak, exc.min_peak_bytes) if p is not None), default=None)
            continue
        rows.append(_row(plan, plan.budget_bytes, plan.solve_time_s))
    rows.sort(key=lambda r: -r.budget_bytes)
    return Tradeoff(rows=monotone(rows), references=reference_points(prepared),
                    baseline_peak_bytes=prepared.baseline.peak_bytes, step_ms=prepared.profile.step_ms,
                    min_peak_bytes=min_peak, prepared=prepared)


def _prepared(model: nn.Module, prepared: Prepared | None, inputs: UserInputs, options: PlanOptions | None,
              overrides: Mapping[str, Any]) -> tuple[Prepared, PlanOptions]:
    """The prepared model a sweep plans, and the options it plans with."""
    if prepared is None:
        if overrides.get("profile") is not None and not isinstance(overrides["profile"], Profile):
            raise InputError(f"profile= takes a Prepared from planner.prepare(model, inputs=..., loss_fn=...) or a "
                             f"Profile (planner.profile, planner.load_profile), not "
                             f"{type(overrides['profile']).__name__}")
        opts = resolve(options, overrides, where="sweep")
        get_solver(opts.solver)  # an unknown solver before any work
        return prepare(model, inputs=inputs, options=opts), opts
    if not isinstance(prepared, Prepared):
        raise InputError(f"prepared= takes a Prepared from planner.prepare(model, inputs=..., loss_fn=...), not "
                         f"{type(prepared).__name__}")
    if prepared.model is not model:
        raise OptionError("profile= was prepared for another model instance; pass the same model to sweep")
    fixed = sorted(set(overrides) & set(PREPARED))
    if inputs is not None or fixed:
        raise OptionError(f"{'inputs' if inputs is not None else fixed[0]} is fixed when the profile is prepared; "
                          "pass it to planner.prepare, not to sweep together with profile=")
    return prepared, resolve(options or prepared.options, overrides, where="sweep")


def _row(plan: Plan, budget_bytes: int, solve_time_s: float) -> TradeoffRow:
    return TradeoffRow(budget_bytes=budget_bytes, feasible=True, predicted_peak_bytes=plan.predicted_peak_bytes,
                       predicted_overhead=plan.predicted_overhead, n_segments=len(plan.segments),
                       solve_time_s=solve_time_s, plan=plan)


def _costs(row: TradeoffRow) -> tuple[int, float]:
    """A feasible row's predicted peak (bytes) and overhead, which ``_row`` sets."""
    if row.predicted_peak_bytes is None or row.predicted_overhead is None:
        raise ValueError(f"the row for a budget of {row.budget_bytes} B has no plan")
    return row.predicted_peak_bytes, row.predicted_overhead


def monotone(rows: Sequence[TradeoffRow]) -> tuple[TradeoffRow, ...]:
    """Enforces the sweep's guarantee on rows sorted by budget, largest first.

    Walking up from the smallest budget, a row whose plan costs more than the cheapest
    plan of a smaller budget (or that has no plan while a smaller budget has one) takes
    that plan, which fits its larger budget too.
    """
    out = list(rows)
    best: tuple[float, Plan] | None = None  # overhead and plan of the cheapest smaller budget so far
    for k in range(len(out) - 1, -1, -1):
        row = out[k]
        if best is not None and (not row.feasible or _costs(row)[1] > best[0]):
            plan = dataclasses.replace(best[1], budget_bytes=row.budget_bytes)
            out[k] = row = _row(plan, row.budget_bytes, row.solve_time_s)
        if row.feasible and row.plan is not None and (best is None or _costs(row)[1] <= best[0]):
            best = _costs(row)[1], row.plan
    return tuple(out)


def reference_points(prepared: Prepared) -> tuple[ReferencePoint, ...]:
    """The hand-made strategies of ``REFERENCES`` on the prepared model's memory model
    (``every block`` is left out when the model has no numbered blocks)."""
    memory, out = prepared.memory, []
    for label, name in REFERENCES:
        try:
            solution = SOLVERS[name](memory, prepared.baseline.peak_bytes, deadline=Deadline.after(0.0))
        except OptionError:  # every_block on a model without a container of numbered blocks
            continue
        out.append(ReferencePoint(name=label, predicted_peak_bytes=simulate(memory, solution.plan).peak_bytes,
                                  predicted_overhead=solution.recompute_us / memory.step_us,
                                  n_segments=len(solution.plan)))
    return tuple(out)


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the non-dominated ``(memory, overhead)`` points (both minimised), one per
    distinct point, by increasing memory."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1], i))
    front: list[int] = []
    for i in order:
        if not front or points[i][1] < points[front[-1]][1]:
            front.append(i)
    return front


def knee_index(front: Sequence[tuple[float, float]]) -> int | None:
    """Index of the knee of a Pareto front given by increasing memory (decreasing overhead).

    With both axes normalised to [0, 1] the front runs from (0, 1) to (1, 0); the knee is
    the interior point with the largest distance ``(1 - x - y) / √2`` below that chord.
    None with fewer than three points or when no point lies below the chord.
    """
    if len(front) < 3:
        return None
    (x0, y0), (x1, y1) = front[0], front[-1]
    if x1 <= x0 or y0 <= y1:
        return None
    distance = [(1 - (x - x0) / (x1 - x0) - (y - y1) / (y0 - y1)) / math.sqrt(2) for x, y in front]
    best = max(range(1, len(front) - 1), key=lambda i: distance[i])
    return best if distance[best] > 1e-12 else None


def block_columns(prepared: Prepared) -> list[tuple[str, int, int]]:
    """``(label, first node, stop node)`` of each repeated block, or of each chunk without blocks."""
    regions = prepared.regions
    if regions.blocks:
        return [(path, regions.starts[first], regions.bounds(stop - 1)[1])
                for path, (first, stop) in zip(regions.block_paths, regions.blocks)]
    return [(f"chunk {k}", *regions.bounds(k)) for k in range(regions.n_chunks)]


def _checkpointed_nodes(prepared: Prepared, plan: Plan | None) -> set[int] | None:
    if plan is None:
        return None
    index = prepared.profile.node_index()
    return {index[name] for seg in plan.segments for name in seg.nodes if name in index}


def _pandas() -> Any:
    try:
        import pandas
    except ImportError as exc:
        raise ImportError("this view needs pandas: pip install pandas (or ckplan[notebook])") from exc
    return pandas


def _percent(overhead: float | None) -> str:
    return "—" if overhead is None else f"+{100 * overhead:.1f}%"


def tradeoff_html(tradeoff: Tradeoff) -> str:
    """A notebook summary of a ``Tradeoff``: one table row per budget, the knee marked."""
    knee = tradeoff.knee()
    rows = [[format_bytes(r.budget_bytes), "yes" if r.feasible else "no",
             "—" if r.predicted_peak_bytes is None else format_bytes(r.predicted_peak_bytes),
             _percent(r.predicted_overhead), "—" if r.n_segments is None else str(r.n_segments),
             f"{r.solve_time_s:.2f} s", "knee" if knee is not None and r is knee else ""] for r in tradeoff.rows]
    refs = [[p.name, format_bytes(p.predicted_peak_bytes), _percent(p.predicted_overhead), str(p.n_segments)]
            for p in tradeoff.references]
    lowest = "" if tradeoff.min_peak_bytes is None else f"; no plan below {format_bytes(tradeoff.min_peak_bytes)}"
    return (f"<div><p><b>ckplan trade-off</b>: {len(tradeoff.rows)} budgets, un-checkpointed peak "
            f"{html.escape(format_bytes(tradeoff.baseline_peak_bytes))}, step {tradeoff.step_ms:.2f} ms"
            f"{html.escape(lowest)}</p>"
            + html_table(["budget", "feasible", "predicted peak", "overhead", "segments", "solve", ""], rows)
            + "<p>reference strategies</p>" + html_table(["strategy", "predicted peak", "overhead", "segments"], refs)
            + "</div>")
