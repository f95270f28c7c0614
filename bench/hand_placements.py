"""ckplan against the placements a user writes by hand, each at that placement's own measured peak.

    python bench/hand_placements.py                                  # gpt_large, writes bench/results/hand_placements.md
    python bench/hand_placements.py --examples gpt resnet --runs 7

For each example: every block checkpointed alone and √n groups of blocks (``planner.solve.baselines``),
each measured (peak of live tensor storages, ``measure_peak``: a plain loop, the output kept through
backward). ckplan then plans at exactly that measured peak, whole segments and selective, and the
three modules are timed interleaved with the un-checkpointed model (``step_samples_ms``: ``--runs``
rounds of one step each after a warm-up round; one thread). Overhead = median step time over the
un-checkpointed median, minus 1; the spread is the overhead of the fastest and slowest step.
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from compare_strategies import load  # noqa: E402


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f}"


def rows_for(name: str, runs: int) -> list[str]:
    from planner.capture.inputs import as_inputs
    from planner.errors import PlannerError
    from planner.pipeline import plan_for, plan_from_solution, prepare
    from planner.profiling.measure import measure_peak, step_samples_ms
    from planner.solve.registry import SOLVERS

    model, inputs, loss_fn = load(name)
    example = as_inputs(model, inputs)
    prepared = prepare(model, inputs=inputs, loss_fn=loss_fn)
    baseline = prepared.baseline.peak_bytes
    out = []
    for hand in ("every_block", "sqrt_n"):
        try:
            placed = plan_from_solution(prepared, SOLVERS[hand](prepared.memory, baseline), baseline)
        except PlannerError as exc:
            out.append(f"| {name} | {hand} | n/a: {str(exc)[:60]} | | | | |")
            continue
        peak = measure_peak(placed.module, example, loss_fn)
        plans = {hand: (placed, "FIXED", 0.0)}
        for kind, selective in (("ckplan whole-segment", False), ("ckplan selective", True)):
            try:
                plan = plan_for(prepared, peak, selective=selective)
                plans[kind] = (plan, plan.solver_status, plan.solve_time_s)
            except PlannerError as exc:
                out.append(f"| {name} | {kind} at {hand}'s peak | infeasible: {str(exc)[:60]} | | | | |")
        samples = step_samples_ms([model, *(p.module for p, _, _ in plans.values())], example, loss_fn, runs=runs)
        base = statistics.median(samples[0])
        for (kind, (plan, status, solve_s)), times in zip(plans.items(), samples[1:]):
            measured = peak if kind == hand else measure_peak(plan.module, example, loss_fn)
            saves = sum(len(s.saved_nodes) for s in plan.segments)
            label = kind if kind == hand else f"{kind} at {hand}'s peak"
            out.append(f"| {name} | {label} | {len(plan.segments)} / {saves} | {mib(plan.predicted_peak_bytes)} / "
                       f"{mib(measured)} | {plan.predicted_overhead:+.1%} | {statistics.median(times) / base - 1:+.1%} "
                       f"({min(times) / base - 1:+.1%} .. {max(times) / base - 1:+.1%}) | {status}, {solve_s:.1f} s |")
            print(out[-1], flush=True)
        out.append(f"| {name} | (un-checkpointed) | | {mib(baseline)} | | {base:.0f} ms per step | |")
        del plans
        gc.collect()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", nargs="+", default=["gpt_large"])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "hand_placements.md"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name in args.examples:
        rows += rows_for(name, args.runs)
    head = ["# ckplan against hand placements, at each placement's measured peak", "",
            f"`python bench/hand_placements.py --examples {' '.join(args.examples)} --runs {args.runs}` on "
            f"{platform.machine()}, torch {torch.__version__}, 1 thread. Peaks in MiB (predicted / measured, a plain "
            "loop: the output kept through backward). Overhead = step time / un-checkpointed step - 1, median of "
            f"{args.runs} interleaved steps (fastest .. slowest).", "",
            "| example | plan | segments / saves | peak pred / meas | overhead pred | overhead meas | solver |",
            "|---|---|---|---|---|---|---|"]
    Path(args.out).write_text("\n".join(head + rows) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
