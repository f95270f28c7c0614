"""What ``ckplan`` prints: the report (rich), the JSON object, errors, progress and the emitted source.

Rendering only: ``cli.py`` decides what to run and calls these with plain data.
The report goes to stdout; progress and errors to stderr.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from typing import Any

from rich import box
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from planner.common.budget import format_bytes
from planner.errors import InfeasibleBudget
from planner.plan import (
    GROUP_COLUMNS,
    Plan,
    Segment,
    group_cells,
    nothing_checkpointed,
    offload_text,
    reserve_text,
    shapes_text,
)
from planner.solve.result import SolverStatus

MAX_PATHS = 3
"""Segments spanning more module paths than this are shown as ``first … last (N parts)``."""

_STAGES = {
    "load": "load: running the model file",
    "capture": "capture: tracing the model with torch.fx",
    "profile": "profile: one training step, node by node",
    "solve": "solve: choosing segments ({solver}, limit {time_limit_s:g} s)",
    "rewrite": "rewrite: generating the checkpointed module",
    "verify": "verify: measuring real steps with and without the plan",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class Verification:
    """Measured training steps of the model and of the planned module (``--verify``)."""

    baseline_peak_bytes: int
    """Measured peak of one step without the plan."""
    planned_peak_bytes: int
    """Measured peak of one step with the plan."""
    baseline_step_ms: float
    """Median step time without the plan, ms."""
    planned_step_ms: float
    """Median step time with the plan, ms."""
    runs: int
    """Timed steps per module (interleaved, after one warm-up round)."""

    @property
    def measured_overhead(self) -> float:
        """Extra step time of the plan, as a fraction of the un-checkpointed step."""
        return self.planned_step_ms / self.baseline_step_ms - 1 if self.baseline_step_ms > 0 else math.nan


class StageProgress:
    """A spinner per pipeline stage on stderr; a no-op when disabled. Call it with each stage's name."""

    def __init__(self, console: Console, *, enabled: bool, solver: str, time_limit_s: float) -> None:
        self._progress = Progress(SpinnerColumn(finished_text="[green]✓"), TextColumn("{task.description}"),
                                  TimeElapsedColumn(), console=console, transient=True) if enabled else None
        self._task: TaskID | None = None
        self._labels = {k: v.format(solver=solver, time_limit_s=time_limit_s) for k, v in _STAGES.items()}

    def __enter__(self) -> StageProgress:
        if self._progress is not None:
            self._progress.start()
        return self

    def __call__(self, stage: str) -> None:
        if self._progress is None:
            return
        if self._task is not None:
            self._progress.update(self._task, total=1, completed=1)
        self._task = self._progress.add_task(self._labels.get(stage, stage), total=None)

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()


# -- the human report ------------------------------------------------------------------------------------------


def print_report(console: Console, plan: Plan, *, model_file: str, solver: str, quiet: bool, explain: bool,
                 verification: Verification | None, saved: str | None, emitted: str | None) -> None:
    """The header, the segment table (unless ``quiet``), and the sections asked for."""
    console.print(header(plan, model_file=model_file, solver=solver))
    if explain:
        print_explain(console, plan)
    elif not quiet:
        _section(console, segments_table(plan) if plan.segments else
                 Text(nothing_checkpointed(plan), style="green"))
    if plan.family is not None and not quiet:
        _section(console, shape_groups_table(plan))
    if verification is not None:
        _section(console, verification_table(plan, verification))
    written = [f"{what} {path}" for what, path in (("plan saved to", saved), ("module source written to", emitted))
               if path]
    if written and not quiet:
        _section(console, Text("\n".join(written)))


def header(plan: Plan, *, model_file: str, solver: str) -> Table:
    """The model file, then baseline peak → predicted peak (a compiled step's measured, the eager model's beside it)
    and the budget, the overhead, the solver."""
    compiled, stage = plan.compiled_step, plan.pipeline_stage
    baseline, peak = ((compiled.baseline_peak_bytes, compiled.peak_bytes) if compiled is not None
                      else (stage.baseline_peak_bytes, stage.peak_bytes) if stage is not None
                      else (plan.baseline_peak_bytes, plan.predicted_peak_bytes))
    change = peak / baseline - 1 if baseline else 0.0
    share = plan.budget_bytes / baseline if baseline else math.nan
    count = len(plan.segments)
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="dim")
    grid.add_column()
    grid.add_row(Text("ckplan", style="bold"), Text(model_file, style="bold cyan"))
    grid.add_row("peak", Text.assemble((format_bytes(baseline), "bold"), " → ", (format_bytes(peak), "bold green"),
                                       f" ({100 * change:+.1f}%)"))
    if compiled is not None:
        eager = f"{format_bytes(plan.baseline_peak_bytes)} → {format_bytes(plan.predicted_peak_bytes)}"
        grid.add_row("compiled", f"{compiled.how}, the step measured at the allocator; the eager model: {eager}")
    if stage is not None:
        step = f"{format_bytes(plan.baseline_peak_bytes)} → {format_bytes(plan.predicted_peak_bytes)}"
        grid.add_row("pipeline", f"stage {stage.rank}, {stage.in_flight} microbatches in flight, each other one "
                                 f"holding {format_bytes(stage.per_microbatch_bytes)}; one microbatch's step: {step}")
    what = "compiled step" if compiled is not None else "stage's peak" if stage is not None else "peak"
    grid.add_row("budget", f"{format_bytes(plan.budget_bytes)} ({100 * share:.0f}% of the un-checkpointed {what})")
    if plan.counted:
        grid.add_row("counted", "; ".join(plan.counted))
    reserve = reserve_text(plan)
    if reserve:
        grid.add_row("reserved", reserve)
    grid.add_row("overhead", Text.assemble(
        (f"+{100 * plan.predicted_overhead:.1f}%", "bold yellow"),
        f" predicted: {plan.recompute_ms:.2f} ms recomputed per {plan.step_ms:.2f} ms step"
        + (f", {plan.offload.exposed_ms:.2f} ms of copies the compute does not hide" if plan.offload else "")))
    if plan.offload is not None:
        grid.add_row("offload", offload_text(plan.offload).removeprefix("offloads ").replace(
            " activation(s), ", " activations, ", 1))
    saved = sum(len(seg.saved_nodes) for seg in plan.segments)
    keeps = f", {saved} op output{'' if saved == 1 else 's'} kept inside them" if saved else ""
    grid.add_row("plan", Text.assemble(
        f"{count} checkpointed segment{'' if count == 1 else 's'}{keeps}, solver {solver} ",
        (str(plan.solver_status), "green" if plan.solver_status == SolverStatus.OPTIMAL else "yellow"),
        "" if plan.chunks is None else f" among {plan.chunks} chunks",
        _gap(plan), f" in {plan.solve_time_s:.2f} s, on {plan.device}"))
    grid.add_row("capture", plan.capture_method.label)
    if plan.profile_pieces > 1 and plan.profile_peak_bytes is not None:
        grid.add_row("profile", f"in {plan.profile_pieces} pieces (the un-checkpointed step does not fit on "
                                f"{plan.device}): profiling peaked at {format_bytes(plan.profile_peak_bytes)}")
    for note in plan.capture_notes:
        grid.add_row("", Text(note.splitlines()[0][:160], style="dim"))
    return grid


def _gap(plan: Plan) -> str:
    """How far a FEASIBLE plan may be from the best one, from the solver's proven bound ("" if none)."""
    bound = plan.recompute_bound_ms
    if plan.solver_status != SolverStatus.FEASIBLE or bound is None or bound <= 0 or plan.recompute_ms <= 0:
        return ""
    return f" (at most {100 * (1 - bound / plan.recompute_ms):.1f}% more recompute than the best plan)"


def _section(console: Console, renderable: Table | Text) -> None:
    console.print()
    console.print(renderable)


def _table(title: str) -> Table:
    """A section's table: a bold title, a ruled header, no outer frame."""
    return Table(box=box.SIMPLE_HEAD, show_edge=False, title=title, title_justify="left", title_style="bold")


def segments_table(plan: Plan) -> Table:
    """One row per segment: module paths, graph nodes, bytes freed, recompute time, and (selective plans)
    how many op outputs it keeps."""
    table = _table("checkpointed segments")
    table.add_column("#", justify="right")
    table.add_column("modules", overflow="fold")
    table.add_column("nodes", justify="right")
    table.add_column("frees", justify="right")
    table.add_column("recompute", justify="right")
    selective = any(seg.saved_nodes for seg in plan.segments)
    if selective:
        table.add_column("keeps", justify="right")
    for i, seg in enumerate(plan.segments):
        row: list[str | Text] = [str(i), Text(short_paths(seg.module_paths)), str(len(seg.nodes)),
                                 format_bytes(seg.freed_bytes), f"{seg.recompute_ms:.2f} ms"]
        table.add_row(*row, *([f"{len(seg.saved_nodes)} ops"] if selective else []))
    return table


def shape_groups_table(plan: Plan) -> Table:
    """A plan that follows the batch: one row per shape group planned so far (``plan.group_cells``)."""
    assert plan.family is not None
    steps = shapes_text(dict(sorted(plan.family.grid.steps.items())))
    table = _table(f"follows the batch: shape groups so far (grid step {steps}; others planned when first seen)")
    for column in GROUP_COLUMNS:
        table.add_column(column, justify="left" if column.startswith("shapes") else "right")
    for cells in group_cells(plan):
        table.add_row(*cells)
    return table


def short_paths(paths: tuple[str, ...] | list[str]) -> str:
    """``a, b, c`` or ``blocks.0 … blocks.3 (10 parts)``."""
    return ", ".join(paths) if len(paths) <= MAX_PATHS else f"{paths[0]} … {paths[-1]} ({len(paths)} parts)"


def print_explain(console: Console, plan: Plan) -> None:
    """Per segment what it frees and costs; what the peak is made of; the largest activations kept and why."""
    if plan.segments:
        _section(console, explain_segments(plan.segments))
    else:
        _section(console, Text("nothing checkpointed: the un-checkpointed peak "
                               f"{format_bytes(plan.baseline_peak_bytes)}"
                           f" already fits the budget {format_bytes(plan.budget_bytes)}", style="green"))
    parts = _table(f"what the peak {format_bytes(plan.predicted_peak_bytes)} is made of")
    parts.add_column("component")
    parts.add_column("bytes", justify="right")
    for name, nbytes in plan.peak_breakdown.items() if plan.peak_breakdown else ():
        parts.add_row(Text(name), format_bytes(nbytes))
    _section(console, parts)
    if plan.sac_op_us is not None and plan.sac_cost_source is not None:
        _section(console, Text(f"selective checkpointing charged {plan.sac_op_us:.1f} us per op of a segment that "
                               f"keeps op outputs ({plan.sac_cost_source.label})"))
    if not plan.largest_kept:
        _section(console, Text("no activation is alive at the peak"))
        return
    kept = _table("largest activations kept at the peak")
    kept.add_column("activation (node)", overflow="fold")
    kept.add_column("bytes", justify="right")
    kept.add_column("why it stays", overflow="fold")
    for node, nbytes, reason in plan.largest_kept:
        kept.add_row(Text(node), format_bytes(nbytes), Text(reason))
    _section(console, kept)


def explain_segments(segments: tuple[Segment, ...]) -> Table:
    """Every segment in full: all module paths, its node range, the nodes it keeps (selective), bytes freed,
    ms recomputed, buffers restored."""
    table = _table("checkpointed segments in detail")
    table.add_column("#", justify="right")
    table.add_column("modules and nodes", overflow="fold")
    table.add_column("frees", justify="right")
    table.add_column("recomputes", justify="right")
    table.add_column("KiB freed per ms", justify="right")
    for i, seg in enumerate(segments):
        nodes = seg.nodes[0] if len(seg.nodes) == 1 else f"{seg.nodes[0]} … {seg.nodes[-1]}"
        plural = "" if len(seg.nodes) == 1 else "s"
        what = Text.assemble((", ".join(seg.module_paths), "cyan"), f"\n{len(seg.nodes)} node{plural}: {nodes}")
        if seg.saved_nodes:
            what.append(f"\nkeeps the outputs of {len(seg.saved_nodes)} node{'' if len(seg.saved_nodes) == 1 else 's'} "
                        f"(not re-run): {', '.join(seg.saved_nodes)}")
        if seg.restore_buffers:
            owners = sorted({name.rsplit(".", 1)[0] for name in seg.restore_buffers})
            what.append(f"\nrestores {len(seg.restore_buffers)} buffers of {_paths_text(owners)} after "
                        "recomputing (updated once a step)")
        rate = f"{seg.freed_bytes / 1024 / seg.recompute_ms:,.0f}" if seg.recompute_ms > 0 else "∞"
        table.add_row(str(i), what, format_bytes(seg.freed_bytes), f"{seg.recompute_ms:.2f} ms", rate)
    return table


def verification_table(plan: Plan, v: Verification) -> Table:
    """Measured next to predicted: both peaks, both step times, the overhead."""
    table = _table(f"verify: real training steps (median of {v.runs})")
    table.add_column("")
    table.add_column("predicted", justify="right")
    table.add_column("measured", justify="right")
    table.add_row("peak without the plan", format_bytes(plan.baseline_peak_bytes), format_bytes(v.baseline_peak_bytes))
    fits = v.planned_peak_bytes <= plan.budget_bytes
    table.add_row("peak with the plan", format_bytes(plan.predicted_peak_bytes),
                  Text(format_bytes(v.planned_peak_bytes) + (" ✓ fits" if fits else " ✗ over budget"),
                       style="green" if fits else "bold red"))
    table.add_row("step without the plan", f"{plan.step_ms:.2f} ms", f"{v.baseline_step_ms:.2f} ms")
    table.add_row("step with the plan", f"{plan.step_ms * (1 + plan.predicted_overhead):.2f} ms",
                  f"{v.planned_step_ms:.2f} ms")
    table.add_row("overhead", f"+{100 * plan.predicted_overhead:.1f}%", f"{100 * v.measured_overhead:+.1f}%")
    return table


# -- JSON, errors, emitted source -------------------------------------------------------------------------------


def plan_json(plan: Plan, *, model_file: str, solver: str, verification: Verification | None,
              saved: str | None, emitted: str | None) -> dict[str, Any]:
    """The ``--json`` object: the plan's numbers and segments (not its source), and the verification."""
    data: dict[str, Any] = {"model_file": model_file, "solver": solver}
    data.update({k: v for k, v in plan.to_dict().items() if k not in ("format", "version", "source", "family")})
    data["shape_groups"] = None if plan.family is None else plan.family.table()
    data["largest_kept"] = [{"node": n, "bytes": b, "reason": r} for n, b, r in plan.largest_kept]
    if verification is not None:
        data["verify"] = {
            "baseline_peak_bytes": verification.baseline_peak_bytes,
            "planned_peak_bytes": verification.planned_peak_bytes,
            "baseline_step_ms": verification.baseline_step_ms,
            "planned_step_ms": verification.planned_step_ms,
            "measured_overhead": verification.measured_overhead,
            "predicted_peak_bytes": plan.predicted_peak_bytes,
            "predicted_overhead": plan.predicted_overhead,
            "fits_budget": verification.planned_peak_bytes <= plan.budget_bytes,
            "runs": verification.runs,
        }
    data["saved"], data["emitted"] = saved, emitted
    return data


def infeasible_json(exc: InfeasibleBudget) -> dict[str, Any]:
    """The ``--json`` object of an infeasible budget; ``min_peak_bytes`` and ``breakdown`` are null when no
    plan satisfies the constraints at all (contradictory overrides)."""
    return {"error": "infeasible", "message": str(exc), "budget_bytes": exc.budget_bytes,
            "min_peak_bytes": exc.min_peak_bytes, "breakdown": exc.breakdown.to_dict() if exc.breakdown else None,
            "proven": exc.proven, "max_chunks": exc.max_chunks}


def print_json(data: dict[str, Any]) -> None:
    """Exactly one JSON object on stdout."""
    sys.stdout.write(json.dumps(data, indent=2) + "\n")
    sys.stdout.flush()


def print_error(err: Console, message: str, *, full: bool = True) -> None:
    """``ckplan: error: message`` on stderr, never wrapped or read as markup; one line unless ``full``."""
    first, _, rest = message.strip().partition("\n")
    if rest and not full:
        message = f"{first} (--debug shows the rest)"
    err.print(Text.assemble(("ckplan: error: ", "bold red"), message), soft_wrap=True, highlight=False)


def print_infeasible(err: Console, exc: InfeasibleBudget) -> None:
    """The smallest reachable peak, what it consists of, and the budget to ask for instead."""
    if exc.reason:  # the user's overrides (must_save/must_recompute) are the cause
        err.print(Text.assemble(("ckplan: infeasible: ", "bold red"), exc.reason), soft_wrap=True, highlight=False)
    if exc.min_peak_bytes is None:
        err.print(Text.assemble(("ckplan: infeasible: ", "bold red"), "no checkpointing plan satisfies the "
                                "constraints at any budget, so there is no smallest peak to compare the budget ",
                                (format_bytes(exc.budget_bytes), "bold"), " with; change --must-save/--must-recompute"),
                  soft_wrap=True, highlight=False)
        return
    err.print(Text.assemble(
        ("ckplan: infeasible: ", "bold red"), "budget ", (format_bytes(exc.budget_bytes), "bold"),
        " is below the smallest peak any checkpointing plan reaches, ", (format_bytes(exc.min_peak_bytes), "bold"),
    ), soft_wrap=True, highlight=False)
    if not exc.breakdown:  # measured, not predicted (--compiled): there are no parts to show
        return
    table = _table("the smallest peak consists of")
    table.add_column("component")
    table.add_column("bytes", justify="right")
    total = 0
    for name, nbytes in exc.breakdown.items() if exc.breakdown else ():
        if nbytes:
            table.add_row(Text(name), format_bytes(nbytes))
        total += nbytes
        if total == exc.min_peak_bytes and nbytes:  # the components are complete; what follows details them
            table.rows[-1].end_section = True
            table.add_row(Text("total", style="bold"), Text(format_bytes(total), style="bold"), end_section=True)
    err.print(table)
    err.print(Text(f"raise the budget to at least {format_bytes(exc.min_peak_bytes)} "
                   f"(--budget {exc.min_peak_bytes}) or shrink the batch"
                   + (f"; planned for {exc.setting}" if exc.setting else "")), soft_wrap=True, highlight=False)


def emitted_source(plan: Plan, *, model_file: str, model_class: str, budget: int | str,
                   save_path: str | None) -> str:
    """``plan.source`` under a header saying what it is and how to get the module for real."""
    plan_file = save_path or "plan.json"
    lines = [
        f"# Generated by ckplan from {model_file}: the checkpointed module for a budget of "
        f"{format_bytes(plan.budget_bytes)} ({len(plan.segments)} segment(s), predicted peak "
        f"{format_bytes(plan.predicted_peak_bytes)}, overhead +{100 * plan.predicted_overhead:.1f}%).",
        f"# `_ckplan_base` stands for your model's class ({model_class}); the generated class subclasses it.",
        "# This file is for reading and review, not importing. The supported way to get the module is:",
        f"#     ckplan {model_file} --budget {budget} --save {plan_file}",
        f"#     module = planner.load_plan({plan_file!r}).apply(model)",
        "",
    ]
    return "\n".join(lines) + "\n" + plan.source.rstrip("\n") + "\n"


def _paths_text(paths: list[str]) -> str:
    return ", ".join(paths) if len(paths) <= 2 else f"{paths[0]} … {paths[-1]} ({len(paths)} modules)"
