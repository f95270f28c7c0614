"""Plans from a step profiled in pieces against plans from the whole step's profile, measured side by side.

    python bench/fitting.py                                  # writes bench/results/fitting.md
    python bench/fitting.py --examples gpt --budgets 50% --out -

Each example is profiled twice in one process: whole (its memory and times measured in one step), and in
pieces, as if the device had 90% of the un-checkpointed step's memory left (memory from the meta
replay, times measured piece by piece). Each profile is planned at the same budgets; both plans' peaks
are measured, and their step times measured interleaved (median of ``--runs``). Then the capped process
of ``tests/test_fitting.py``: a GPT whose plain step does not fit, planned and trained there.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import runpy
import subprocess
import sys
from pathlib import Path

import torch

from planner import InfeasibleBudget
from planner.capture.inputs import as_inputs
from planner.common.budget import format_bytes
from planner.pipeline import plan_for, prepare
from planner.profiling import api
from planner.profiling.measure import measure_peak, step_times_ms

ROOT = Path(__file__).resolve().parent.parent


def rows(name: str, budgets: list[str], runs: int) -> list[str]:
    example = runpy.run_path(str(ROOT / "examples" / f"{name}.py"))
    model, inputs, loss_fn = example["model"], example["inputs"], example.get("loss_fn")
    whole = prepare(model, inputs=inputs, loss_fn=loss_fn)
    room = whole.profile.baseline_peak_bytes * 9 // 10  # the whole step needs more than FIT_SHARE of it
    headroom = api.headroom_bytes
    api.headroom_bytes = lambda device: room
    try:
        pieces = prepare(model, inputs=inputs, loss_fn=loss_fn)
    finally:
        api.headroom_bytes = headroom
    example_inputs = as_inputs(model, inputs)
    out = []
    for budget in budgets:
        try:
            full_plan = plan_for(whole, budget)
            piece_plan = plan_for(pieces, full_plan.budget_bytes)
        except InfeasibleBudget as exc:
            out.append(f"| {name} | {budget} | infeasible: {str(exc)[:80]} | | | | | |")
            continue
        measured = [measure_peak(p.module, example_inputs, loss_fn) for p in (full_plan, piece_plan)]
        base_ms, full_ms, piece_ms = step_times_ms([model, full_plan.module, piece_plan.module], example_inputs,
                                                   loss_fn, runs=runs)
        out.append(
            f"| {name} | {budget} | {pieces.profile.pieces} pieces, {format_bytes(pieces.profile.profile_peak_bytes)} "
            f"(whole {format_bytes(whole.profile.profile_peak_bytes)}) | "
            f"{format_bytes(full_plan.predicted_peak_bytes)} / {format_bytes(measured[0])} | "
            f"{format_bytes(piece_plan.predicted_peak_bytes)} / {format_bytes(measured[1])} | "
            f"+{full_plan.predicted_overhead:.1%} / +{piece_plan.predicted_overhead:.1%} | "
            f"{full_ms / base_ms - 1:+.1%} / {piece_ms / base_ms - 1:+.1%} | {piece_ms / full_ms - 1:+.1%} |")
        print(out[-1], flush=True)
    return out


def capped_row() -> str:
    """The capped process of tests/test_fitting.py, run here: its numbers as one table row."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}

    def run(what: str, growth: int, budget: int) -> dict:
        done = subprocess.run([sys.executable, str(ROOT / "tests" / "capped.py"), what, str(growth), str(budget)],
                              capture_output=True, text=True, env=env, timeout=900, check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])

    plain = run("plain", 0, 0)
    cap, budget = plain["growth"] * 2 // 3, plain["growth"] // 4
    failed, planned = run("plain", cap, 0), run("plan", cap, budget)
    return (f"| GPT width 256, 6 blocks, 24 x 256 tokens | plain step needs {format_bytes(plain['growth'])} of "
            f"address space; capped at {format_bytes(cap)} | plain step: "
            f"{'fails' if not failed['ok'] else 'runs (!)'} | "
            + (f"planned at {format_bytes(planned['budget'])}: {planned['pieces']} pieces, profiling peak "
               f"{format_bytes(planned['profile_peak'])}, {planned['segments']} segments, predicted "
               f"{planned['predicted']} B, measured {planned['measured']} B |" if planned["ok"]
               else f"failed: {planned['error']} |"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--examples", nargs="+", default=["gpt", "resnet", "gpt_large"])
    p.add_argument("--budgets", nargs="+", default=["70%", "50%"])
    p.add_argument("--runs", type=int, default=9)
    p.add_argument("--no-capped", action="store_true")
    p.add_argument("--out", default=str(ROOT / "bench/results/fitting.md"), help="markdown file; - for none")
    args = p.parse_args()
    lines = ["# Plans from a step profiled in pieces vs from the whole step", "",
             f"`python bench/fitting.py --examples {' '.join(args.examples)} --budgets {' '.join(args.budgets)} "
             f"--runs {args.runs}` on {platform.machine()}, {torch.get_num_threads()} threads, torch "
             f"{torch.__version__}, CPU. Each example profiled whole and in pieces (as if 90% of its "
             "un-checkpointed peak were left on the device: pieces fit 70% of that), planned at the same budget from each; peaks "
             "measured (live tensor storages), step times of the model and both plans interleaved (medians).", "",
             "| example | budget | pieces profile (its peak) | whole-profile plan pred / meas | pieces-profile plan "
             "pred / meas | pred overhead whole / pieces | meas overhead whole / pieces | pieces plan vs whole plan |",
             "|---|---|---|---|---|---|---|---|"]
    for name in args.examples:
        lines += rows(name, args.budgets, args.runs)
    if not args.no_capped:
        lines += ["", "## A process too small for the plain step", "",
                  "`tests/test_fitting.py`'s capped process (RLIMIT_AS at 2/3 of the plain step's address space, "
                  "MALLOC_MMAP_THRESHOLD_=131072, budget 1/4 of the plain step):", "",
                  "| model | cap | without a plan | ckplan |", "|---|---|---|---|", capped_row()]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out != "-":
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
