"""How planning time grows with the graph: transformer-shaped synthetic graphs, 100 to 5000 nodes.

    python bench/solver_scaling.py                       # writes bench/results/solver_scaling.md
    python bench/solver_scaling.py --nodes 100 2000 --budget 0.5 --time-limit 60

For each size and chunk cap: regions + memory model build time, then each solver at
the budget (a fraction of the un-checkpointed peak): status, recompute time found,
proven bound, wall time. More chunks give finer plans (less recompute) and a larger
problem.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from planner.memory.build import build_model
from planner.memory.regions import find_regions
from planner.memory.simulate import simulate
from planner.memory.synthetic import transformer_profile
from planner.solve.deadline import Deadline
from planner.solve.registry import SOLVERS
from planner.solve.result import NoSolution

ROOT = Path(__file__).resolve().parent.parent
NODES_PER_LAYER = 17


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", nargs="+", type=int, default=[100, 500, 1000, 2000, 5000])
    parser.add_argument("--budget", type=float, default=0.5)
    parser.add_argument("--solvers", nargs="+", default=["cpsat", "rotor"])
    parser.add_argument("--max-chunks", nargs="+", type=int, default=[64, 128, 256])
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "solver_scaling.md"))
    args = parser.parse_args()
    lines = [
        "# Solver scaling on transformer-shaped graphs",
        "",
        f"`python bench/solver_scaling.py --nodes {' '.join(map(str, args.nodes))} --budget {args.budget} "
        f"--max-chunks {' '.join(map(str, args.max_chunks))} --time-limit {args.time_limit:g}` on {os.cpu_count()} CPU cores. "
        f"Budget: {args.budget:.0%} of the un-checkpointed peak. `planner.memory.synthetic.transformer_profile`: "
        f"{NODES_PER_LAYER} nodes per block.",
        "",
        "| nodes | blocks | chunks | model build | solver | status | recompute | bound | gap | time |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for nodes, max_chunks in ((n, k) for n in args.nodes for k in args.max_chunks):
        layers = max(1, round((nodes - 2) / NODES_PER_LAYER))
        profile = transformer_profile(layers)
        started = time.perf_counter()
        regions = find_regions(profile, max_chunks=max_chunks)
        if max_chunks > min(args.max_chunks) and regions.n_chunks < max_chunks:
            continue  # the graph has fewer cut positions than the cap: same row as a smaller cap
        model = build_model(profile, regions)
        build_s = time.perf_counter() - started
        budget = int(simulate(model, ()).peak_bytes * args.budget)
        for name in args.solvers:
            began = time.perf_counter()
            try:
                sol = SOLVERS[name](model, budget, deadline=Deadline.after(args.time_limit))
                bound = "" if sol.bound_us is None else f"{sol.bound_us / 1000:.1f} ms"  # None: nothing proven
                gap = "" if sol.bound_us is None else f"{(sol.recompute_us - sol.bound_us) / max(1, sol.recompute_us):.1%}"
                result = f"{sol.status} | {sol.recompute_us / 1000:.1f} ms | {bound} | {gap}"
            except NoSolution as exc:
                result = f"{'INFEASIBLE' if exc.infeasible else 'UNKNOWN'} | | | "
            elapsed = time.perf_counter() - began
            lines.append(f"| {len(profile.nodes)} | {layers} | {regions.n_chunks} | {build_s:.2f} s | {name} | "
                         f"{result} | {elapsed:.2f} s |")
            print(lines[-1], flush=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
