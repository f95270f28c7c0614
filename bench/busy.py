"""Planning on a busy CPU: planning time and the profiled step against a quiet machine.

    python bench/busy.py                          # gpt_large, writes bench/results/busy.md
    python bench/busy.py --example gpt --runs 1 --out /tmp/busy.md

Each row plans the example (``optimize`` at ``--budget`` of its un-checkpointed peak) in a fresh process and reports
the wall time of the whole call (capture, profile, solve) and the profile's step (forward + backward, ms):

- quiet: nothing else runs;
- busy: ``--hogs`` other torch processes (one intra-op thread each, a matmul loop) keep every core busy;
- busy, torch's threads: as busy, with the profile run with torch's own thread count instead of the cores
  left free (``planner.profiling.cores``), to show what that choice is worth.

Ratios are against the quiet row of the same run (medians of ``--runs``).
"""

from __future__ import annotations

import argparse
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
HOG = """
import sys, time, torch
torch.set_num_threads(1)
a = torch.randn(384, 384)
end = time.time() + float(sys.argv[1])
while time.time() < end:
    (a @ a).relu_()
"""


def plan_once(example: str, budget: str, torch_threads: bool) -> dict:
    """Plans ``example`` in this process: the call's wall time and the profile's step."""
    import runpy

    sys.path.insert(0, str(ROOT))
    from planner.pipeline import plan_for, prepare
    from planner.profiling import cores

    if torch_threads:
        cores.fair_threads = lambda free, current: current  # type: ignore[assignment]  # the choice left out
    ns = runpy.run_path(str(ROOT / "examples" / f"{example}.py"))
    start = time.perf_counter()
    prepared = prepare(ns["model"], inputs=ns["inputs"], loss_fn=ns.get("loss_fn"))
    plan = plan_for(prepared, budget)
    seconds = time.perf_counter() - start
    prof = prepared.profile
    return {"plan_s": seconds, "step_ms": prof.step_fwd_ms + prof.step_bwd_ms,
            "nodes_ms": sum(n.fwd_ms + n.bwd_ms for n in prof.nodes), "sac_op_us": prof.sac_op_us,
            "overhead": plan.predicted_overhead}


def run_row(example: str, budget: str, hogs: int, torch_threads: bool) -> dict:
    """One row's planning in a fresh process, with ``hogs`` competing processes running meanwhile."""
    others = [subprocess.Popen([sys.executable, "-c", HOG, "3600"]) for _ in range(hogs)]
    try:
        time.sleep(2 if hogs else 0)  # the competitors are up and computing
        cmd = [sys.executable, __file__, "--one", example, "--budget", budget] + (["--torch-threads"] if torch_threads
                                                                                  else [])
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        return json.loads(out.strip().splitlines()[-1])
    finally:
        for p in others:
            p.kill()
            p.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--example", default="gpt_large")
    p.add_argument("--budget", default="65%")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--hogs", type=int, default=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                   else os.cpu_count() or 1)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "busy.md"))
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--torch-threads", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(plan_once(args.one, args.budget, args.torch_threads)))
        return
    rows = {"quiet": (0, False), "busy": (args.hogs, False), "busy, torch's threads": (args.hogs, True)}
    results: dict[str, list[dict]] = {name: [] for name in rows}
    for _ in range(args.runs):  # rows interleaved: a drift of the machine hits each alike
        for name, (hogs, torch_threads) in rows.items():
            results[name].append(run_row(args.example, args.budget, hogs, torch_threads))
            print(name, results[name][-1], flush=True)
    med = {name: {k: statistics.median(r[k] for r in rs) for k in ("plan_s", "step_ms", "nodes_ms")}
           for name, rs in results.items()}
    quiet = med["quiet"]
    lines = [
        "# Planning on a busy CPU", "",
        f"`python bench/busy.py --example {args.example} --budget {args.budget} --runs {args.runs} --hogs {args.hogs}` "
        f"on {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} "
        f"intra-op threads by default), CPU. Busy: {args.hogs} other processes, one thread each, in a matmul loop. "
        f"Medians of {args.runs} runs, each in a fresh process, rows interleaved.", "",
        "| | planning (whole `optimize`) | vs quiet | profiled step | vs quiet | sum of per-node times | "
        "SAC cost per op | predicted overhead |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, m in med.items():
        rs = results[name]
        sac = statistics.median(r["sac_op_us"] or 0.0 for r in rs)
        over = statistics.median(r["overhead"] for r in rs)
        lines.append(f"| {name} | {m['plan_s']:.1f} s | {m['plan_s'] / quiet['plan_s']:.2f}x | {m['step_ms']:,.0f} ms | "
                     f"{m['step_ms'] / quiet['step_ms']:.2f}x | {m['nodes_ms']:,.0f} ms | {sac:.0f} us | "
                     f"+{over:.1%} |")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
