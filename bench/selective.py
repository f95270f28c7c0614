"""Selective (op-level saves) vs whole-segment plans vs every block, measured on every example.

    python bench/selective.py                          # writes bench/results/selective.md
    python bench/selective.py --examples gpt --budgets 50 --runs 7

For each example and budget (a fraction of the un-checkpointed peak) the same prepared profile is
planned with ``selective=True`` and ``selective=False``, and every block is checkpointed alone
(``SOLVERS["every_block"]``, plus a selective plan at every_block's predicted peak, to compare at
equal memory). Per row: predicted and measured peak (live tensor storages, ``measure_peak``),
predicted overhead (recompute / step) and measured step overhead against the original model
(``step_times_ms``: interleaved steps of all the modules of one example and budget, median of
``--runs``), the number of saved ops, solver status and time.
"""

from __future__ import annotations

import argparse
import gc
import platform
import runpy
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
EXAMPLES = ["seed_cnn", "gpt", "resnet"]


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f}"


def rows_for(name: str, fractions: list[int], runs: int) -> list[str]:
    from planner.capture import as_inputs
    from planner.errors import PlannerError
    from planner.measure import measure_peak, step_times_ms
    from planner.optimize import plan_for, plan_from_solution, prepare
    from planner.solvers import SOLVERS

    ns = runpy.run_path(str(ROOT / "examples" / f"{name}.py"))
    model, inputs, loss_fn = ns["model"], ns["inputs"], ns["loss_fn"]
    example = as_inputs(model, inputs)
    prepared = prepare(model, inputs=inputs, loss_fn=loss_fn)
    baseline = prepared.baseline.peak_bytes
    out = []
    cases = [(f"{f}%", f"{f}%") for f in fractions]
    try:
        every = plan_from_solution(prepared, SOLVERS["every_block"](prepared.memory, 0), baseline)
        cases.append(("every_block's peak", every.predicted_peak_bytes))
    except ValueError:
        every = None
    for label, budget in cases:
        plans = {}
        for kind, selective in (("selective", True), ("whole-segment", False)):
            started = time.perf_counter()
            try:
                plans[kind] = (plan_for(prepared, budget, selective=selective), time.perf_counter() - started)
            except PlannerError as exc:
                out.append(f"| {name} | {label} | {kind} | infeasible: {str(exc)[:70]} | | | | | |")
        if label.endswith("%") and every is not None and label == cases[0][0]:
            plans["every_block"] = (every, 0.0)
        if not plans:
            continue
        times = step_times_ms([model, *(p.module for p, _ in plans.values())], example, loss_fn, runs=runs)
        for (kind, (plan, solve_s)), ms in zip(plans.items(), times[1:]):
            measured = measure_peak(plan.module, example, loss_fn)
            saved = sum(len(s.saved_nodes) for s in plan.segments)
            out.append(f"| {name} | {label} | {kind} | {len(plan.segments)} / {saved} | {mib(plan.predicted_peak_bytes)}"
                       f" / {mib(measured)} | {plan.predicted_overhead:+.1%} | {ms / times[0] - 1:+.1%} | "
                       f"{plan.solver_status} | {solve_s:.1f} s |")
            print(out[-1], flush=True)
        del plans
        gc.collect()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", nargs="+", default=EXAMPLES)
    parser.add_argument("--budgets", nargs="+", type=int, default=[70, 50, 30])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "selective.md"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name in args.examples:
        rows += rows_for(name, args.budgets, args.runs)
    header = [
        "# Selective vs whole-segment vs every block",
        "",
        f"`python bench/selective.py --examples {' '.join(args.examples)} --budgets "
        f"{' '.join(map(str, args.budgets))} --runs {args.runs}` on {platform.processor() or platform.machine()}, "
        f"torch {torch.__version__}, 1 thread. Peaks in MiB (predicted / measured); overhead = step time / "
        "un-checkpointed step time - 1 (measured: median of interleaved steps); segments / saved ops.",
        "",
        "| example | budget | plan | segments / saves | peak pred / meas | overhead pred | overhead meas |"
        " status | solve |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    Path(args.out).write_text("\n".join(header + rows) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
