"""Every strategy on every example at several budgets, measured: does cpsat beat the baselines?

    python bench/compare_strategies.py                    # writes bench/results/strategies.md
    python bench/compare_strategies.py --examples gpt --budgets 70 50 --no-compile

Part 1 (in process): for each example, budget fraction and strategy (cpsat, rotor, and the
fixed placements none / every_block / sqrt_n, plus cpsat at every_block's predicted peak):
predicted and measured peak (live tensor storages, the planner's own ruler), measured step
overhead against the original model (median of interleaved steps), solve time.

Part 2 (fresh subprocess per row, because dispatch-mode trackers cannot see inside compiled
code): peak RSS growth during one step (after ``malloc_trim``; median of 3) and median step
time, for eager (no plan, cpsat plan) and torch.compile (no budget, ``activation_memory_budget``
= fraction, compiled cpsat plan). RSS growth reads 25-45% above the exact tensor count (allocator
overhead, oneDNN workspaces); it is a like-for-like ruler between eager and compiled rows.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ["seed_cnn", "gpt", "resnet"]


def load(name: str):
    """The example's model, inputs and loss_fn (``example_module``)."""
    module = example_module(name)
    return module.model, module.inputs, module.loss_fn


def example_module(name: str):
    """``examples/<name>.py`` as an importable module (``runpy`` namespaces are not: dynamo imports the module
    of every global it meets in inlined code, which fails for ``<run_path>``)."""
    spec = importlib.util.spec_from_file_location(f"ckplan_example_{name}", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f}"


def strategy_rows(name: str, fractions: list[int], runs: int) -> list[str]:
    from planner.capture.inputs import as_inputs
    from planner.errors import PlannerError
    from planner.pipeline import plan_from_solution, prepare
    from planner.profiling.measure import measure_peak, step_times_ms
    from planner.solve.deadline import Deadline
    from planner.solve.registry import SOLVERS
    from planner.solve.result import NoSolution

    model, inputs, loss_fn = load(name)
    example = as_inputs(model, inputs)
    prepared = prepare(model, inputs=inputs, loss_fn=loss_fn)
    baseline = prepared.baseline.peak_bytes
    cases: list[tuple[str, str, int]] = [(s, "fixed", baseline) for s in ("none", "every_block", "sqrt_n")]
    for fraction in fractions:
        cases += [(s, f"{fraction}%", int(baseline * fraction / 100)) for s in ("cpsat", "rotor")]
    rows = []
    for strategy, label, budget in cases:
        try:
            started = time.perf_counter()
            solution = SOLVERS[strategy](prepared.memory, budget, deadline=Deadline.after(30.0))
        except (NoSolution, ValueError, PlannerError) as exc:
            rows.append(f"| {name} | {strategy} | {label} | | infeasible or n/a: {str(exc)[:60]} | | | | |")
            continue
        plan = plan_from_solution(prepared, solution, budget)
        if strategy in ("every_block", "sqrt_n"):  # cpsat at the memory the fixed placement reaches
            cases.append(("cpsat", f"= {strategy}'s peak", plan.predicted_peak_bytes))
        measured = measure_peak(plan.module, example, loss_fn)
        base_ms, plan_ms = step_times_ms([model, plan.module], example, loss_fn, runs=runs)
        rows.append(f"| {name} | {strategy} | {label} | {len(plan.segments)} | {mib(plan.predicted_peak_bytes)} / "
                    f"{mib(measured)} | {plan.predicted_overhead:+.1%} | {plan_ms / base_ms - 1:+.1%} | "
                    f"{plan.solver_status} | {time.perf_counter() - started:.2f} s |")
        print(rows[-1], flush=True)
        del plan
        gc.collect()
    return rows


def worker(name: str, mode: str, fraction: int, runs: int) -> dict:
    """One configuration in a fresh process: RSS growth of one step and median step time."""
    import torch._functorch.config as functorch_config

    from planner.api import optimize

    model, inputs, loss_fn = load(name)
    module = model
    if mode in ("eager-cpsat", "compile-cpsat"):
        module = optimize(model, f"{fraction}%", inputs=inputs, loss_fn=loss_fn).module
    if mode.startswith("compile"):
        functorch_config.activation_memory_budget = fraction / 100 if mode == "compile-budget" else 1.0
        module = torch.compile(module)
    return measure_step(module, model, inputs, loss_fn, runs)


def measure_step(module, model, inputs, loss_fn, runs: int) -> dict:
    """Peak RSS growth during one step of ``module`` (sharing ``model``'s parameters; median of 3, each
    after ``malloc_trim``) and its median step time over ``runs``, after two warm-up steps (compiling)."""
    from planner.capture.step import backward

    def step() -> None:
        backward(loss_fn(module(*inputs)))
        for p in model.parameters():
            p.grad = None

    for _ in range(2):  # compile and warm up
        step()
    libc = ctypes.CDLL("libc.so.6")
    growths = []
    for _ in range(3):
        gc.collect()
        libc.malloc_trim(0)  # give freed heap pages back, so resident memory is what is in use
        rss = _status("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS counter
        step()
        growths.append(_status("VmHWM") - rss)
    growth = statistics.median(growths)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    return {"rss_growth_bytes": growth, "step_ms": statistics.median(times)}


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def compile_rows(name: str, fractions: list[int], runs: int) -> list[str]:
    rows = []
    configs = [("eager-none", 100), ("compile-none", 100)]
    for fraction in fractions:
        configs += [("eager-cpsat", fraction), ("compile-budget", fraction), ("compile-cpsat", fraction)]
    results = {}
    for mode, fraction in configs:
        out = subprocess.run([sys.executable, __file__, "--worker", name, mode, str(fraction), str(runs)],
                             capture_output=True, text=True, timeout=1200)
        if out.returncode != 0:
            rows.append(f"| {name} | {mode} | {fraction}% | failed: {out.stderr.strip().splitlines()[-1][:80]} | |")
            continue
        result = json.loads(out.stdout.strip().splitlines()[-1])
        results[mode, fraction] = result
        base = results.get(("eager-none", 100), result)
        rows.append(f"| {name} | {mode} | {fraction}% | {mib(result['rss_growth_bytes'])} | "
                    f"{result['step_ms']:.1f} ms ({result['step_ms'] / base['step_ms'] - 1:+.1%}) |")
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        name, mode, fraction, runs = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
        print(json.dumps(worker(name, mode, fraction, runs)))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", nargs="+", default=EXAMPLES)
    parser.add_argument("--budgets", nargs="+", type=int, default=[90, 70, 50, 30])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "strategies.md"))
    args = parser.parse_args()
    head = (f"`python bench/compare_strategies.py --budgets {' '.join(map(str, args.budgets))} --runs {args.runs}` "
            f"on {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, CPU.")
    lines = ["# Strategies compared", "", head, "",
             "## Eager strategies (peaks: live tensor storages, parameters included)", "",
             "| example | strategy | budget | segments | peak pred / meas MiB | pred overhead | "
             "meas overhead (median of interleaved) | status | solve |", "|---|---|---|---|---|---|---|---|---|"]
    for name in args.examples:
        lines += strategy_rows(name, args.budgets, args.runs)
    if not args.no_compile:
        lines += ["", "## torch.compile vs eager (fresh process per row; peak RSS growth during one step)", "",
                  "| example | mode | budget | RSS growth MiB | step time (vs eager-none) |", "|---|---|---|---|---|"]
        for name in args.examples:
            lines += compile_rows(name, args.budgets, args.runs)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
