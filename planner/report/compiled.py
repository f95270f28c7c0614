"""What ``ckplan --compiled`` prints: the chosen partition and every probe it measured."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.text import Text

from planner.common.units import format_bytes
from planner.compiled.api import CompiledPlan
from planner.compiled.backend import Graphs
from planner.compiled.search import Probe, Source
from planner.report.render import _section, _table


def _label(p: Probe) -> str:
    if p.source is Source.PLAN:
        return "ckplan's plan, compiled" + {Graphs.ONE: "", Graphs.INPUTS_APART: " with the input embedding apart",
                                            Graphs.PER_REGION: " with the graph broken at its layers"}[p.graphs]
    return f"activation_memory_budget={p.fraction:g}"


def print_compiled(console: Console, plan: CompiledPlan, *, model_file: str, quiet: bool) -> None:
    console.print(Text.assemble(("ckplan ", "bold"), model_file, ": ", plan.summary()), soft_wrap=True, highlight=False)
    if quiet:
        return
    table = _table("probes (peak measured, one training step; step: median, interleaved)")
    for column in ("partition", "peak", "fits", "step", "vs 1.0"):
        table.add_column(column, justify="left" if column == "partition" else "right")
    for i, p in enumerate(plan.probes):
        table.add_row(Text(_label(p), style="bold" if i == plan.chosen else ""), format_bytes(p.peak_bytes),
                      "yes" if p.peak_bytes <= plan.budget_bytes else "no",
                      f"{p.step_ms:.1f} ms" if p.step_ms is not None else "",
                      f"{p.step_ms / plan.baseline_step_ms - 1:+.1%}" if p.step_ms is not None else "")
    _section(console, table)


def compiled_json(plan: CompiledPlan, *, model_file: str) -> dict[str, Any]:
    return {"model_file": model_file, "compiled": True, "source": plan.source.value, "fraction": plan.fraction,
            "budget_bytes": plan.budget_bytes, "peak_bytes": plan.peak_bytes,
            "baseline_peak_bytes": plan.baseline_peak_bytes, "step_ms": plan.step_ms,
            "baseline_step_ms": plan.baseline_step_ms,
            "segments": len(plan.plan.segments) if plan.plan is not None else None,
            "probes": [{"source": p.source.value, "fraction": p.fraction, "peak_bytes": p.peak_bytes,
                        "step_ms": p.step_ms, "compile_s": round(p.compile_s, 2), "graphs": p.graphs.value}
                       for p in plan.probes]}
