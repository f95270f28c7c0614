"""Selective (op-level saves) vs whole-segment plans vs every block, measured on every example.

    python bench/selective.py                          # writes bench/results/selective.md
    python bench/selective.py --examples gpt --budgets 50 --runs 7
    python bench/selective.py --compiled --examples gpt --budgets 50   # bench/results/selective_compiled.md

For each example and budget (a fraction of the un-checkpointed peak) the same prepared profile is
planned with ``selective=True`` and ``selective=False``, and every block is checkpointed alone
(``SOLVERS["every_block"]``, plus a selective plan at every_block's predicted peak, to compare at
equal memory). Per row: predicted and measured peak (live tensor storages, ``measure_peak``),
predicted overhead (recompute / step) and measured step overhead against the original model
(``step_times_ms``: interleaved steps of all the modules of one example and budget, median of
``--runs``), the number of saved ops, solver status and time.

``--compiled``: fresh process per row, measured as in ``bench/compare_strategies.py`` part 2 (peak RSS
growth during one step, median step time): the un-checkpointed model eager and compiled,
torch.compile with ``activation_memory_budget`` = the budget fraction, and eager and
``torch.compile(plan.module)`` of the whole-segment plan, the selective plan, the selective plan solved
without SAC's dispatch charge (compiled code has no dispatch modes), and the whole-segment plan with
every save its segments allow. The plans are made once, here, and handed to the workers as segment
lists, so every row of a plan runs the same segments.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import runpy
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
EXAMPLES = ["seed_cnn", "gpt", "resnet"]


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f}"


def rows_for(name: str, fractions: list[int], runs: int) -> list[str]:
    from planner.capture.inputs import as_inputs
    from planner.errors import PlannerError
    from planner.pipeline import plan_for, plan_from_solution, prepare
    from planner.profiling.measure import measure_peak, step_times_ms
    from planner.solve.registry import SOLVERS

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


def plan_with_every_save(prepared, budget_bytes: int):
    """The whole-segment plan for ``budget_bytes`` with every save its segments allow
    (``every_save`` in ``tests/forcing.py``), SAC's dispatch cost not charged."""
    from forcing import every_save

    from planner.pipeline import plan_from_solution
    from planner.solve.deadline import Deadline
    from planner.solve.default import solve
    from planner.solve.result import Solution

    memory = prepared.memory
    chunks = solve(memory, budget_bytes, deadline=Deadline.after(30.0)).plan
    saves = every_save(prepared.profile, memory, chunks, prepared.rules.savable)
    return plan_from_solution(prepared, Solution(plan=chunks, status="FIXED", recompute_us=0, bound_us=0,
                                                 solve_time_s=0.0, saves=saves), budget_bytes)


def uncharged(prepared, budget_bytes: int):
    """The selective plan CP-SAT picks when saves cost no dispatch time (as in compiled code)."""
    from planner.memory.candidates import save_options
    from planner.pipeline import plan_from_solution
    from planner.solve.deadline import Deadline
    from planner.solve.default import solve

    free = dataclasses.replace(prepared.memory, sac_chunk_us=prepared.memory.sac_chunk_us * 0)
    options = save_options(prepared.profile, free, savable=prepared.rules.savable)
    return plan_from_solution(prepared, solve(free, budget_bytes, deadline=Deadline.after(30.0), options=options), budget_bytes)


def compiled_rows(name: str, fraction: int, runs: int, passes: int) -> list[str]:
    """Eager vs compiled rows of one example and budget, one fresh process each (``worker``)."""
    from compare_strategies import load

    from planner.capture.inputs import as_inputs
    from planner.pipeline import plan_for, prepare
    from planner.profiling.measure import measure_peak

    model, inputs, loss_fn = load(name)
    prepared = prepare(model, inputs=inputs, loss_fn=loss_fn)
    budget = f"{fraction}%"
    whole = plan_for(prepared, budget, selective=False)
    plans = {"whole-segment": whole, "selective": plan_for(prepared, budget, selective=True),
             "selective, no SAC charge": uncharged(prepared, whole.budget_bytes),
             "every allowed save": plan_with_every_save(prepared, whole.budget_bytes)}
    example = as_inputs(model, inputs)
    configs = [("-", "eager-none", None), ("-", "compile-none", None), ("-", "compile-budget", None)]
    specs: dict[str, str] = {}
    folder = Path(tempfile.mkdtemp(prefix="ckplan_selective_"))
    for kind, plan in plans.items():
        spec = json.dumps([{"nodes": s.nodes, "restore_buffers": s.restore_buffers, "saved_nodes": s.saved_nodes}
                           for s in plan.segments])
        same = next((k for k, v in specs.items() if v == spec), None)
        specs[kind] = spec
        if same is not None:
            print(f"{kind}: same plan as {same}", flush=True)
            continue
        path = folder / f"{len(specs)}.json"
        path.write_text(spec)
        configs += [(kind, "eager", str(path)), (kind, "compile", str(path))]
    results: dict[tuple, list[dict]] = {}
    failed: dict[tuple, str] = {}
    for turn in range(passes):  # every row once per pass: slow drifts of a shared machine hit all rows alike
        for kind, mode, path in configs:
            out = subprocess.run([sys.executable, __file__, "--worker", name, mode, str(fraction), str(runs),
                                  path or "-"], capture_output=True, text=True, timeout=1800)
            if out.returncode != 0:
                failed[kind, mode] = (out.stderr.strip().splitlines() or ["?"])[-1][:80]
                continue
            results.setdefault((kind, mode), []).append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"pass {turn + 1}: {name} {kind} {mode}: {results[kind, mode][-1]}", flush=True)
    base = statistics.median(r["step_ms"] for r in results["-", "eager-none"])
    rows = []
    for kind, mode, path in configs:
        label = kind if path else "-"
        sames = [k for k, v in specs.items() if k != kind and v == specs.get(kind)]
        if sames:
            label += f" (= {', '.join(sames)})"
        plan = plans.get(kind)
        shape = f"{len(plan.segments)} / {sum(len(s.saved_nodes) for s in plan.segments)}" if plan else ""
        peak = (f"{mib(plan.predicted_peak_bytes)} / {mib(measure_peak(plan.module, example, loss_fn))}"
                if plan and mode == "eager" else "")
        if (kind, mode) in failed:
            rows.append(f"| {name} | {budget} | {label} | {mode} | {shape} | {peak} | failed: {failed[kind, mode]} | |")
            continue
        got = results[kind, mode]
        step = statistics.median(r["step_ms"] for r in got)
        rows.append(f"| {name} | {budget} | {label} | {mode} | {shape} | {peak} | "
                    f"{' / '.join(mib(r['rss_growth_bytes']) for r in got)} | "
                    f"{' / '.join(format(r['step_ms'], '.1f') for r in got)} ms | {step / base - 1:+.1%} |")
        print(rows[-1], flush=True)
    return rows


def worker(name: str, mode: str, fraction: int, runs: int, spec_path: str) -> dict:
    """One row in a fresh process: the model, or the plan in ``spec_path`` rewritten from a fresh capture,
    eager or compiled (``compile-budget``: the model under ``activation_memory_budget`` = fraction)."""
    import torch._functorch.config as functorch_config
    from compare_strategies import load, measure_step

    from planner.capture.api import capture
    from planner.capture.inputs import as_inputs
    from planner.profiling.api import capture_inputs
    from planner.rewrite.graph import SegmentSpec, rewrite

    torch.set_num_threads(1)  # the machine is shared: two OpenMP threads on a busy core stall each other
    model, inputs, loss_fn = load(name)
    module = model
    if spec_path != "-":
        specs = [SegmentSpec(**{k: tuple(v) for k, v in s.items()}) for s in json.loads(Path(spec_path).read_text())]
        captured = capture(model, capture_inputs(model, as_inputs(model, inputs)))
        module = rewrite(model, captured, specs).module
    if mode.startswith("compile"):
        functorch_config.activation_memory_budget = fraction / 100 if mode == "compile-budget" else 1.0
        module = torch.compile(module)
    return measure_step(module, model, inputs, loss_fn, runs)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        name, mode, fraction, runs, spec_path = sys.argv[2:7]
        print(json.dumps(worker(name, mode, int(fraction), int(runs), spec_path)))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", nargs="+", default=EXAMPLES)
    parser.add_argument("--budgets", nargs="+", type=int, default=[70, 50, 30])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--compiled", action="store_true", help="eager vs torch.compile rows, fresh process each")
    parser.add_argument("--passes", type=int, default=3, help="--compiled: fresh processes per row, in turns")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.compiled:
        compiled_main(args)
        return
    args.out = args.out or str(ROOT / "bench" / "results" / "selective.md")
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


def compiled_main(args) -> None:
    out = args.out or str(ROOT / "bench" / "results" / "selective_compiled.md")
    rows = []
    for name in args.examples:
        for fraction in args.budgets:
            rows += compiled_rows(name, fraction, args.runs, args.passes)
    header = [
        "# Selective plans under torch.compile",
        "",
        f"`python bench/selective.py --compiled --examples {' '.join(args.examples)} --budgets "
        f"{' '.join(map(str, args.budgets))} --runs {args.runs} --passes {args.passes}` on {platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, CPU, 1 thread. One fresh process per row and pass (passes in turns, "
        "so slow drifts of the shared machine hit every row alike): peak RSS growth during one step (median of 3, "
        "after `malloc_trim`) and median step time of `--runs` steps after two warm-up steps "
        "(`bench/compare_strategies.py` part 2), one value per pass; overhead: median over passes vs eager-none's. "
        "Segments / saved ops; eager peak: the plan's predicted and measured eager peak (live tensor storages, MiB).",
        "",
        "| example | budget | plan | mode | segments / saves | eager peak pred / meas | RSS growth MiB per pass | "
        "step time per pass | overhead vs eager-none |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    Path(out).write_text("\n".join(header + rows) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
