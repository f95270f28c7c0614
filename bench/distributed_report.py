"""2 ranks (gloo, CPU, 127.0.0.1): FSDP2 and DDP training with and without a plan, per rank.

Runs the workers of ``tests/test_distributed.py`` (4 residual MLP blocks of width 64, 1024 rows per
rank, 3 AdamW steps, plan at 60% planned on rank 0 and broadcast) and writes
``bench/results/distributed.md``: losses, all-gathers per step, predicted and measured peaks.

    python bench/distributed_report.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from test_distributed import ddp_worker, fsdp_worker, run_ranks  # noqa: E402

from planner.common.budget import format_bytes  # noqa: E402


def rows(engine: str, results: list[dict]) -> list[str]:
    out = []
    for rank, r in enumerate(results):
        for name in ("unplanned", "planned", "joint"):
            if name not in r:
                continue
            run = r[name]
            predicted = r["baseline"] if name == "unplanned" else r["predicted"] if name == "planned" else None
            out.append(f"| {engine} | {rank} | {name} | {', '.join(f'{x:.6f}' for x in run['losses'])} | "
                       f"{run['all_gathers'] if engine == 'fsdp' else '-'} | "
                       f"{format_bytes(predicted) if predicted else '-'} | {format_bytes(run['peak'])} | "
                       f"{format_bytes(r['budget']) if name == 'planned' else '-'} |")
    return out


def main() -> None:
    lines = ["# Distributed plans on 2 ranks (gloo, CPU)", "",
             "`python bench/distributed_report.py`. Model and protocol: `tests/test_distributed.py`. Peaks are",
             "per rank during step 2 (optimizer state allocated): resident tensors (local shards, optimizer",
             "state, inputs, DDP's buckets) plus the highest rise of the allocator during the step. `joint` is",
             "a forced segment of blocks 0-2 (three FSDP units re-run together).", "",
             "| engine | rank | module | losses (3 AdamW steps) | all-gathers per step | predicted peak | "
             "measured peak | budget |",
             "|---|---|---|---|---|---|---|---|"]
    for engine, worker in (("fsdp", fsdp_worker), ("ddp", ddp_worker)):
        with tempfile.TemporaryDirectory() as tmp:
            results = run_ranks(worker, Path(tmp), timeout_s=300)
        lines += rows(engine, results)
        lines.append(f"| {engine} | all | plan | segments {results[0]['segments']} (same on every rank: "
                     f"{all(r['same_plan'] for r in results)}) | | | | |")
    text = "\n".join(lines) + "\n"
    (ROOT / "bench" / "results" / "distributed.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
