"""Plans every bundled example at given budgets and measures the result against the prediction.

    python bench/examples_report.py                 # 50% budgets, writes bench/results/examples.md
    python bench/examples_report.py --budgets 70% 50% smallest --runs 9

For each example and budget: baseline (un-checkpointed) predicted and measured peak, the
plan's predicted and measured peak, measured step-time overhead against the original
model (median of interleaved steps), predicted overhead, solver status and time.
"""

from __future__ import annotations

import argparse
import platform
import runpy
import time
from pathlib import Path

import torch

from planner import InfeasibleBudget, optimize
from planner.capture.inputs import as_inputs
from planner.common.budget import format_bytes
from planner.profiling.measure import measure_peak, step_times_ms

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ["seed_cnn", "gpt", "resnet"]


def row(name: str, budget: str, runs: int) -> str:
    example = runpy.run_path(str(ROOT / "examples" / f"{name}.py"))
    model, inputs, loss_fn = example["model"], example["inputs"], example["loss_fn"]
    if budget == "smallest":  # the smallest peak any plan reaches
        try:
            optimize(model, 1, inputs=inputs, loss_fn=loss_fn)
        except InfeasibleBudget as exc:
            budget = str(exc.min_peak_bytes)
    started = time.perf_counter()
    try:
        plan = optimize(model, int(budget) if budget.isdigit() else budget, inputs=inputs, loss_fn=loss_fn)
    except InfeasibleBudget as exc:
        return (f"| {name} | {budget} | {format_bytes(exc.budget_bytes)} | infeasible: smallest reachable peak "
                f"{format_bytes(exc.min_peak_bytes)} | | | | | | |")
    total_s = time.perf_counter() - started
    example_inputs = as_inputs(model, inputs)
    base_measured = measure_peak(model, example_inputs, loss_fn)
    plan_measured = measure_peak(plan.module, example_inputs, loss_fn)
    base_ms, plan_ms = step_times_ms([model, plan.module], example_inputs, loss_fn, runs=runs)
    error = (plan.predicted_peak_bytes - plan_measured) / plan_measured
    return (f"| {name} | {budget} | {format_bytes(plan.budget_bytes)} | {format_bytes(plan.baseline_peak_bytes)} / "
            f"{format_bytes(base_measured)} | {format_bytes(plan.predicted_peak_bytes)} / "
            f"{format_bytes(plan_measured)} ({error:+.1%}) | {len(plan.segments)} | "
            f"+{plan.predicted_overhead:.1%} | {plan_ms / base_ms - 1:+.1%} ({base_ms:.1f} → {plan_ms:.1f} ms) | "
            f"{plan.solver_status} {plan.solve_time_s:.2f} s | {total_s:.1f} s |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", nargs="+", default=["50%"])
    parser.add_argument("--examples", nargs="+", default=EXAMPLES)
    parser.add_argument("--runs", type=int, default=7, help="interleaved timed steps per module")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "examples.md"))
    args = parser.parse_args()
    lines = [
        "# Bundled examples: prediction vs measurement",
        "",
        f"`python bench/examples_report.py --budgets {' '.join(args.budgets)} --runs {args.runs}` on "
        f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}, CPU. "
        "Peaks are live tensor storages (parameters included) counted by the same dispatch-mode tracker "
        "the profiler uses; overhead is the median of interleaved steps.",
        "",
        "| example | budget | bytes | baseline pred / meas | plan pred / meas (err) | segments | "
        "pred overhead | meas overhead (orig → plan) | solver | optimize() |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in args.examples:
        for budget in args.budgets:
            lines.append(row(name, budget, args.runs))
            print(lines[-1], flush=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
