"""ckplan's compiled path against torch.compile's own ``activation_memory_budget``, compiled vs compiled.

    python bench/compiled.py                                   # gpt and gpt_large, into --out (bench/results/compiled.md)
    python bench/compiled.py --examples gpt --passes 3 --runs 5   # the run of bench/results/compiled_gpt.md

Per example:
1. torch.compile at ``activation_memory_budget`` 0.5 and 0.3 (and 1.0, compile's own partition) is
   measured in fresh processes: peak of one step (allocator events, ``measure_peak``).
2. ``optimize_compiled`` is run (a fresh process each) at the measured peak of 0.5 and of 0.3, and
   at ``--below`` (60) % of 1.0's peak (a budget few fractions reach); what it chose (a fraction,
   or ckplan's eager plan compiled, saved as a plan file) and every probe it measured are recorded.
3. Every row is measured again in a fresh process per row and pass, the passes in turns (so slow
   drifts of the shared machine hit every row alike): one warm-up step that compiles, the peak of one
   step, then the median of ``--runs`` steps. Overheads are medians over passes against eager-none and
   compile-none of the same pass.
One thread, as the other benches (``OMP_NUM_THREADS=1``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from compare_strategies import load, mib  # noqa: E402


def worker(config: dict) -> dict:
    """One row in this (fresh) process."""
    import torch

    from planner.capture.inputs import as_inputs
    from planner.capture.step import backward, default_loss, untouched
    from planner.compiled.search import probe
    from planner.plan_file import load_plan
    from planner.profiling.measure import measure_peak, step_samples_ms

    torch.set_num_threads(1)
    model, inputs, loss_fn = load(config["example"])
    example = as_inputs(model, inputs)
    if config["kind"] == "optimize":
        return _optimize(model, inputs, loss_fn, config)
    if config["kind"] == "eager":
        with untouched(model):  # a warm-up step, as the compiled rows' first (compiling) one
            backward((loss_fn or default_loss)(model(*example.args, **example.kwargs)))
        module, peak = model, measure_peak(model, example, loss_fn)
    else:  # compiled: one warm step that compiles, then the peak of the next
        target = model if config["kind"] == "knapsack" else load_plan(config["plan"]).apply(model, inputs=inputs)
        module, measured = probe(target, config.get("fraction", 1.0), example, loss_fn, keep_output=True)
        peak = measured.peak_bytes
    samples = step_samples_ms([module], example, loss_fn, runs=config["runs"])[0]
    return {"peak_bytes": peak, "step_ms": statistics.median(samples), "min_ms": min(samples),
            "max_ms": max(samples)}


def _optimize(model, inputs, loss_fn, config: dict) -> dict:
    from planner.compiled.api import optimize_compiled
    from planner.compiled.search import Source
    from planner.errors import InfeasibleBudget

    start = time.perf_counter()
    try:
        plan = optimize_compiled(model, config["budget"], inputs=inputs, loss_fn=loss_fn, runs=config["runs"])
    except InfeasibleBudget as exc:
        return {"infeasible": True, "min_peak_bytes": exc.min_peak_bytes, "took_s": time.perf_counter() - start}
    took = time.perf_counter() - start
    if plan.plan is not None:
        plan.plan.save(config["plan"])
    return {"source": plan.source.value, "fraction": plan.fraction, "took_s": took,
            "budget_bytes": plan.budget_bytes, "segments": len(plan.plan.segments) if plan.plan else None,
            "probes": [{"source": p.source.value, "fraction": p.fraction, "peak_bytes": p.peak_bytes,
                        "step_ms": p.step_ms} for p in plan.probes],
            "plan_file": config["plan"] if plan.source is Source.PLAN else None}


def run_worker(config: dict) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, __file__, "--worker", json.dumps(config)], capture_output=True, text=True,
                         env=env, cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(f"worker {config} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def example_rows(name: str, passes: int, runs: int, below: int, workdir: Path) -> tuple[list[str], list[str]]:
    base = {"example": name, "runs": runs}
    knapsack = {f: run_worker({**base, "kind": "knapsack", "fraction": f}) for f in (1.0, 0.5, 0.3)}
    targets = [("peak of 0.5", knapsack[0.5]["peak_bytes"]), ("peak of 0.3", knapsack[0.3]["peak_bytes"]),
               (f"{below}% of 1.0's peak", int(knapsack[1.0]["peak_bytes"] * below / 100))]
    rows = {"eager-none": {**base, "kind": "eager"}, "compile-none (1.0)": {**base, "kind": "knapsack", "fraction": 1.0},
            "compile 0.5": {**base, "kind": "knapsack", "fraction": 0.5},
            "compile 0.3": {**base, "kind": "knapsack", "fraction": 0.3}}
    notes = []
    for label, budget in targets:
        plan_file = str(workdir / f"{name}_{len(notes)}.json")
        chose = run_worker({**base, "kind": "optimize", "budget": budget, "plan": plan_file})
        if chose.get("infeasible"):
            notes.append(f"- {name}, budget {mib(budget)} MiB ({label}): infeasible after {chose['took_s']:.0f} s; the "
                         f"smallest measured peak (every fraction and ckplan's plan) is {mib(chose['min_peak_bytes'])} MiB.")
            continue
        what = ("ckplan plan" if chose["source"] == "plan" else f"fraction {chose['fraction']:g}")
        rows[f"ckplan at {label} ({mib(budget)} MiB): {what}"] = (
            {**base, "kind": "plan", "plan": plan_file} if chose["source"] == "plan"
            else {**base, "kind": "knapsack", "fraction": chose["fraction"]})
        probes = ", ".join(f"{'plan' if p['source'] == 'plan' else format(p['fraction'], 'g')}: {mib(p['peak_bytes'])}"
                           for p in chose["probes"])
        notes.append(f"- {name}, budget {mib(budget)} MiB ({label}): optimize_compiled took {chose['took_s']:.0f} s and "
                     f"chose {what}; probes (peak MiB): {probes}.")
    measured = {label: [] for label in rows}
    for _ in range(passes):
        for label, config in rows.items():
            measured[label].append(run_worker(config))
    out = []
    for label, results in measured.items():
        over_eager = statistics.median(r["step_ms"] / e["step_ms"] - 1 for r, e in zip(results, measured["eager-none"]))
        over_compile = statistics.median(r["step_ms"] / c["step_ms"] - 1
                                         for r, c in zip(results, measured["compile-none (1.0)"]))
        peaks = " / ".join(mib(r["peak_bytes"]) for r in results)
        times = " / ".join(f"{r['step_ms']:.1f} ({r['min_ms']:.0f}..{r['max_ms']:.0f})" for r in results)
        out.append(f"| {name} | {label} | {peaks} | {times} | {over_compile:+.1%} | {over_eager:+.1%} |")
    return out, notes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", nargs="+", default=["gpt", "gpt_large"])
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--below", type=int, default=60, help="the third budget: this %% of 1.0's measured peak")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "compiled.md"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    import torch

    rows, notes = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.examples:
            r, n = example_rows(name, args.passes, args.runs, args.below, Path(tmp))
            rows += r
            notes += n
    head = ["# ckplan's compiled path against torch.compile's activation_memory_budget", "",
            f"`python bench/compiled.py --examples {' '.join(args.examples)} --passes {args.passes} --runs {args.runs} "
            f"--below {args.below}` "
            f"on {platform.machine()}, torch {torch.__version__}, CPU, 1 thread. Fresh process per row and pass, "
            "passes in turns. Peak: one training step, the output kept through backward, counted at the allocator "
            "(`measure_peak`), MiB per pass. Step: median of the pass's steps, ms (fastest..slowest). "
            "Overheads: median over passes of step time / the same pass's compile-none (or eager-none) - 1.", "",
            "| example | row | peak MiB per pass | step ms per pass | vs compile-none | vs eager-none |",
            "|---|---|---|---|---|---|"]
    Path(args.out).write_text("\n".join(head + rows + ["", "What optimize_compiled chose:", ""] + notes) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
