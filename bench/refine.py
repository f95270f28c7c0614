"""Refinement to finer chunks (``planner.planning.chunkings.refine``): the plan at the prepared 64 chunks against
the plan ``plan_for`` returns, same budget, same profile, measured side by side.

    OMP_NUM_THREADS=1 python bench/refine.py --examples gpt mixer gpt_large --runs 9   # bench/results/refine.md

Per example and budget (a % of the un-checkpointed peak): predicted overhead and peak of both plans,
their measured peaks (live tensor storages, a plain loop), the median of ``--runs`` interleaved steps
over the plain model's median, minus 1 (fastest .. slowest), and the solve stage's time.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from compare_strategies import load, mib  # noqa: E402


def rows_for(name: str, fractions: list[int], runs: int, time_limit_s: float) -> list[str]:
    from planner.capture.inputs import as_inputs
    from planner.errors import InfeasibleBudget
    from planner.options import PlanOptions
    from planner.pipeline import plan_for, plan_from_solution, prepare
    from planner.planning.chunkings import widen
    from planner.profiling.measure import measure_peak, step_samples_ms
    from planner.solve.deadline import Deadline

    model, inputs, loss_fn = load(name)
    prepared = prepare(model, inputs=inputs, loss_fn=loss_fn)
    example = as_inputs(model, inputs)
    rows = []
    for fraction in fractions:
        budget = prepared.baseline.peak_bytes * fraction // 100
        began = time.perf_counter()
        try:
            coarse_prepared, coarse = widen(prepared, budget, PlanOptions(), Deadline.after(time_limit_s))
        except InfeasibleBudget as exc:
            rows.append(f"| {name} | {fraction}% | infeasible (smallest peak {mib(exc.min_peak_bytes)} MiB) "
                        "| | | | | |")
            continue
        coarse_s = time.perf_counter() - began
        plans = {f"{coarse_prepared.regions.n_chunks} chunks": plan_from_solution(coarse_prepared, coarse, budget),
                 "refined": plan_for(prepared, budget, time_limit_s=time_limit_s)}
        times = {"refined": plans["refined"].solve_time_s, next(iter(plans)): coarse_s}
        samples = step_samples_ms([model, *(p.module for p in plans.values())], example, loss_fn, runs=runs)
        base = statistics.median(samples[0])
        for (kind, plan), ts in zip(plans.items(), samples[1:]):
            rows.append(f"| {name} | {fraction}% | {kind} | {len(plan.segments)} / "
                        f"{sum(len(s.saved_nodes) for s in plan.segments)} | {plan.predicted_overhead:+.1%} | "
                        f"{statistics.median(ts) / base - 1:+.1%} ({min(ts) / base - 1:+.1%} .. "
                        f"{max(ts) / base - 1:+.1%}) | {mib(plan.predicted_peak_bytes)} / "
                        f"{mib(measure_peak(plan.module, example, loss_fn))} | {plan.solver_status}, "
                        f"{times[kind]:.1f} s |")
        print("\n".join(rows[-2:]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", nargs="+", default=["gpt", "mixer", "gpt_large"])
    parser.add_argument("--fractions", nargs="+", type=int, default=[50, 70])
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--time-limit", type=float, default=30.0)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "refine.md"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [row for name in args.examples for row in rows_for(name, args.fractions, args.runs, args.time_limit)]
    head = ["# Refinement to finer chunks: the plan at the prepared chunks against the refined plan", "",
            f"`OMP_NUM_THREADS=1 python bench/refine.py --examples {' '.join(args.examples)} --fractions "
            f"{' '.join(map(str, args.fractions))} --runs {args.runs} --time-limit {args.time_limit:g}` on "
            f"{platform.machine()}, torch {torch.__version__}, CPU, 1 thread. Budget: % of the un-checkpointed "
            f"peak. Overhead: median of {args.runs} interleaved steps over the plain model's median, minus 1 "
            "(fastest .. slowest). Peaks in MiB, predicted / measured (live tensor storages, a plain loop).", "",
            "| example | budget | plan | segments / saves | overhead pred | overhead meas | peak pred / meas | solver, solve time |",
            "|---|---|---|---|---|---|---|---|"]
    Path(args.out).write_text("\n".join(head + rows) + "\n")
    print("\n".join(head + rows))


if __name__ == "__main__":
    main()
