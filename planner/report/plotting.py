"""Every matplotlib figure of ckplan: the trade-off curve, the per-block heatmap, the memory timeline.

Figures are built with ``matplotlib.figure.Figure`` directly, not pyplot: nothing is shown
or kept open, scripts and tests need no backend, and a notebook displays the returned
Figure once (with ``%matplotlib inline``). Memory axes are in MiB, overhead in percent
of the un-checkpointed step time. matplotlib is optional (``pip install 'ckplan[plot]'``): it is
imported when a figure is drawn, so importing this module never needs it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, overload

import numpy as np

from planner.common.budget import format_bytes
from planner.errors import OptionError

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure, SubFigure

    from planner.plan import Plan

class Tradeoff(Protocol):
    """What the trade-off figures read of ``planner.report.explore.Tradeoff`` (which imports this module);
    read-only, as that frozen dataclass's fields are."""

    @property
    def rows(self) -> Sequence[Any]: ...

    @property
    def references(self) -> Sequence[Any]: ...

    @property
    def baseline_peak_bytes(self) -> int: ...

    @property
    def min_peak_bytes(self) -> int | None: ...

    def front(self) -> Sequence[Any]: ...

    def knee(self) -> Any: ...

    def blocks_table(self) -> list[dict[str, Any]]: ...


MIB = 2**20
_PLAN, _BASE, _SHADE, _KNEE, _HOST = "tab:blue", "tab:gray", "tab:orange", "tab:red", "tab:green"
_REFERENCE_MARKERS = {"none": "s", "every block": "D", "√n": "^"}


def _figure_class() -> type[Figure]:
    """matplotlib's ``Figure``, imported on first use.

    Raises:
        OptionError: matplotlib is not installed (it is the ``plot`` extra).
    """
    try:
        import matplotlib  # noqa: F401  (the package first: a stale submodule entry must not hide its absence)
        from matplotlib.figure import Figure
    except ImportError:
        raise OptionError("plotting needs matplotlib: pip install 'ckplan[plot]'") from None
    return Figure


def plot_tradeoff(tradeoff: Tradeoff) -> Figure:
    """Predicted peak (MiB) against predicted overhead (%): every feasible row, the Pareto
    front as a line, the knee starred, and the reference strategies as labelled markers."""
    fig = _figure_class()(figsize=(7, 4.5), layout="constrained")
    ax = fig.subplots()
    feasible = [r for r in tradeoff.rows if r.feasible]
    if feasible:
        ax.scatter([r.predicted_peak_bytes / MIB for r in feasible], [100 * r.predicted_overhead for r in feasible],
                   color=_PLAN, alpha=0.35, label="plan per budget")
    front = tradeoff.front()
    if front:
        ax.plot([r.predicted_peak_bytes / MIB for r in front], [100 * r.predicted_overhead for r in front],
                "o-", color=_PLAN, label="Pareto front")
        for r in front:
            ax.annotate(format_bytes(r.budget_bytes), (r.predicted_peak_bytes / MIB, 100 * r.predicted_overhead),
                        textcoords="offset points", xytext=(4, 4), fontsize=7, color=_PLAN)
    knee = tradeoff.knee()
    if knee is not None:
        ax.plot(knee.predicted_peak_bytes / MIB, 100 * knee.predicted_overhead, "*", color=_KNEE, markersize=16,
                label=f"knee ({format_bytes(knee.budget_bytes)} budget)")
    for ref in tradeoff.references:
        ax.plot(ref.predicted_peak_bytes / MIB, 100 * ref.predicted_overhead, _REFERENCE_MARKERS.get(ref.name, "x"),
                color=_BASE, markersize=8, linestyle="none", label=f"{ref.name} (hand-made)")
    if tradeoff.min_peak_bytes is not None:
        ax.axvline(tradeoff.min_peak_bytes / MIB, color=_KNEE, linestyle=":", linewidth=1,
                   label=f"no plan below {format_bytes(tradeoff.min_peak_bytes)}")
    ax.set_xlabel("predicted peak memory of one training step (MiB)")
    ax.set_ylabel("predicted recompute overhead (% of step time)")
    ax.set_title(f"memory against recompute (un-checkpointed peak {format_bytes(tradeoff.baseline_peak_bytes)})")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def plot_blocks(tradeoff: Tradeoff) -> Figure:
    """Heatmap of ``tradeoff.blocks_table()``: one row per budget (largest on top), one column
    per block (or chunk); the colour is the fraction of the block's nodes checkpointed,
    grey for infeasible budgets."""
    figure_class = _figure_class()
    table = tradeoff.blocks_table()
    labels = [key for key in table[0] if key != "budget_bytes"] if table else []
    size = (max(5.0, 0.45 * len(labels) + 2.5), max(2.5, 0.4 * len(table) + 1.5))
    fig = figure_class(figsize=size, layout="constrained")
    ax = fig.subplots()
    if not labels:
        ax.text(0.5, 0.5, "nothing in this model can be checkpointed", ha="center", va="center")
        ax.set_axis_off()
        return fig
    values = np.array([[np.nan if row[c] is None else row[c] for c in labels] for row in table], dtype=float)
    from matplotlib import colormaps

    cmap = colormaps["Blues"].with_extremes(bad="lightgrey")  # grey: infeasible budgets
    image = ax.imshow(np.ma.masked_invalid(values), aspect="auto", cmap=cmap, vmin=0.0, vmax=1.0,
                      interpolation="nearest")
    ax.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=8)
    base = tradeoff.baseline_peak_bytes
    ax.set_yticks(range(len(table)), [f"{format_bytes(row['budget_bytes'])} ({100 * row['budget_bytes'] / base:.0f}%)"
                                      for row in table], fontsize=8)
    ax.set_xlabel("block" if not labels[0].startswith("chunk ") else "chunk")
    ax.set_ylabel("budget")
    ax.set_title("what each budget checkpoints (grey: infeasible)")
    fig.colorbar(image, ax=ax, label="fraction of the block's nodes checkpointed")
    return fig


@overload
def plot_timeline(plan: Plan, ax: None = None) -> Figure: ...


@overload
def plot_timeline(plan: Plan, ax: Axes) -> Figure | SubFigure: ...


def plot_timeline(plan: Plan, ax: Axes | None = None) -> Figure | SubFigure:
    """Predicted live memory (MiB) over one training step, forward then backward, with and
    without ``plan``; the budget as a horizontal line; checkpointed segments shaded where
    they run forward and where they are recomputed in backward; a plan's offloads as the band above its
    line of what they keep in host memory, with how busy the host link is.

    Args:
        plan: a plan with a ``timeline`` (every plan made by this version, saved or not).
        ax: draw into these axes; default a new Figure.

    Returns:
        The Figure drawn into (``ax``'s SubFigure when it lies in one).

    Raises:
        ValueError: the plan carries no timeline.
        OptionError: matplotlib is not installed.
    """
    figure_class = _figure_class()
    timeline = plan.timeline
    if timeline is None:
        raise ValueError("this plan carries no memory timeline (saved by an older ckplan?); plan again with "
                         "planner.optimize or planner.sweep to plot it")
    if ax is None:
        ax = figure_class(figsize=(9, 4), layout="constrained").subplots()
    n = len(timeline.nodes)
    backward = [i for i in range(n - 1, -1, -1) if timeline.backward_bytes[i] is not None]
    x_bwd = {i: n + j for j, i in enumerate(backward)}
    x = np.arange(n + len(backward))
    planned = [*timeline.forward_bytes, *(timeline.backward_bytes[i] for i in backward)]
    baseline = [*timeline.baseline_forward_bytes, *(timeline.baseline_backward_bytes[i] for i in backward)]
    position = {name: i for i, name in enumerate(timeline.nodes)}
    for k, segment in enumerate(plan.segments):
        inside = [position[name] for name in segment.nodes if name in position]
        if not inside:
            continue
        label = "checkpointed segments" if k == 0 else None
        ax.axvspan(min(inside) - 0.5, max(inside) + 0.5, color=_SHADE, alpha=0.2, linewidth=0, label=label)
        again = [x_bwd[i] for i in inside if i in x_bwd]
        if again:
            ax.axvspan(min(again) - 0.5, max(again) + 0.5, color=_SHADE, alpha=0.2, linewidth=0)
    ax.plot(x, np.array(baseline, dtype=float) / MIB, color=_BASE, linewidth=1.2,
            label=f"without plan (peak {format_bytes(plan.baseline_peak_bytes)})")
    ax.plot(x, np.array(planned, dtype=float) / MIB, color=_PLAN, linewidth=1.5,
            label=f"with plan (peak {format_bytes(plan.predicted_peak_bytes)})")
    if timeline.offloaded_forward_bytes and plan.offload is not None:
        off = [*timeline.offloaded_forward_bytes, *(timeline.offloaded_backward_bytes[i] or 0 for i in backward)]
        on = np.array(planned, dtype=float) / MIB
        spec = plan.offload
        ax.fill_between(x, on, on + np.array(off, dtype=float) / MIB, color=_HOST, alpha=0.35, linewidth=0,
                        label=f"offloaded to host memory ({format_bytes(spec.offloaded_bytes)}; {spec.link_busy()})")
    ax.axhline(plan.budget_bytes / MIB, color=_KNEE, linestyle="--", linewidth=1,
               label=f"budget {format_bytes(plan.budget_bytes)}")
    ax.axvline(n - 0.5, color="black", linewidth=0.8)
    ax.text(n / 2, 1.01, "forward", transform=ax.get_xaxis_transform(), ha="center", va="bottom", fontsize=8)
    ax.text(n + len(backward) / 2, 1.01, "backward", transform=ax.get_xaxis_transform(), ha="center",
            va="bottom", fontsize=8)
    ax.set_xlim(-0.5, len(x) - 0.5)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("graph node (forward in order, then backward in reverse)")
    ax.set_ylabel("predicted live memory (MiB)")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(True, alpha=0.3)
    return ax.figure


def plot_shapes(plan: Plan) -> Figure:
    """A plan that follows the batch, one point per shape group planned so far, against the group's size
    (elements of its largest argument: tokens, for an LM): predicted overhead (%) on the left, and the
    un-checkpointed and predicted peaks (MiB) with the budget on the right.

    Raises:
        ValueError: the plan does not follow the batch.
        OptionError: matplotlib is not installed.
    """
    if plan.family is None:
        raise ValueError("this plan does not follow the batch: plan with follow_batch=True (or shapes=[...])")
    rows = plan.family.table()
    sizes = [max(int(np.prod(shape)) for shape in row["shapes"].values()) for row in rows]
    fig = _figure_class()(figsize=(10, 4), layout="constrained")
    left, right = fig.subplots(1, 2)
    left.plot(sizes, [100 * row["overhead"] for row in rows], marker="o", color=_PLAN)
    left.set_xlabel("group size (elements of its largest input)")
    left.set_ylabel("predicted recompute (% of its step)")
    left.set_ylim(bottom=0)
    right.plot(sizes, [row["baseline_peak_bytes"] / MIB for row in rows], marker="s", color=_BASE,
               label="un-checkpointed")
    right.plot(sizes, [row["predicted_peak_bytes"] / MIB for row in rows], marker="o", color=_PLAN,
               label="with the group's plan")
    right.axhline(plan.budget_bytes / MIB, color=_KNEE, linestyle="--", linewidth=1,
                  label=f"budget {format_bytes(plan.budget_bytes)}")
    right.set_xlabel("group size (elements of its largest input)")
    right.set_ylabel("predicted peak (MiB)")
    right.legend(fontsize=8, loc="upper left")
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
    return fig
