"""The GPT example (8 blocks, tied embedding/head, dropout) on 2 FSDP2 ranks (gloo, CPU), with and
without a plan made on rank 0: losses, all-gathers per step, per-rank predicted and measured peaks.

    python bench/distributed_gpt.py [--budget 60%]      # about 2-3 minutes on 2 cores

Appends its table to ``bench/results/distributed.md``.
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from test_distributed import _init, run_ranks  # noqa: E402

from planner.common.budget import format_bytes  # noqa: E402
from planner.distributed import count_collectives, fully_shard_units, plan_on_rank0, rank_peak_bytes, resident_bytes  # noqa: E402

STEPS = 3


def _train(module, example: dict) -> dict:
    tokens = example["inputs"][0]
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
    losses, gathers, peak = [], [], None
    for step in range(STEPS):
        out = []
        torch.manual_seed(100 + step)  # the same dropout masks with and without the plan

        def one_step(out: list = out) -> None:
            out.append(example["loss_fn"](module(tokens)))
            out[-1].backward()

        with count_collectives() as counts:
            if step == 1:
                peak = rank_peak_bytes(one_step, resident_bytes(module, opt, tokens))
            else:
                one_step()
        opt.step()
        opt.zero_grad()
        losses.append(out[-1].item())
        gathers.append(counts["all_gather_single"])
    return {"losses": losses, "all_gathers": gathers, "peak": peak}


def gpt_worker(rank: int, world_size: int, port: int, out_dir: str, budget: str, units: list | None) -> None:
    _init(rank, world_size, port)
    load = lambda: runpy.run_path(str(ROOT / "examples" / "gpt.py"))
    example = load()
    result = {"unplanned": _train(fully_shard_units(example["model"], units), example)}
    example = load()
    plan = plan_on_rank0(example["model"], budget, inputs=example["inputs"], loss_fn=example["loss_fn"],
                         optimizer="adamw", units=units)
    result.update(segments=[list(s.module_paths) for s in plan.segments], budget=plan.budget_bytes,
                  predicted=plan.predicted_peak_bytes, baseline=plan.baseline_peak_bytes,
                  planned=_train(fully_shard_units(plan.module, units), example))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="60%")
    parser.add_argument("--units", nargs="+",
                        help="FSDP units (default: the blocks), e.g. 'blocks.*.attn' 'blocks.*.mlp'")
    args = parser.parse_args()
    budget, units = args.budget, args.units
    import test_distributed
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:  # run_ranks passes (world_size, port, out_dir); add the budget
        original = mp.start_processes

        def with_budget(fn, args, **kwargs):
            return original(fn, args=(*args, budget, units), **kwargs)

        test_distributed.mp.start_processes = with_budget
        try:
            results = run_ranks(gpt_worker, Path(tmp), timeout_s=900)
        finally:
            test_distributed.mp.start_processes = original
    flag = f" --units {' '.join(units)}" if units else ""
    lines = ["", f"## GPT example (examples/gpt.py), FSDP2 on 2 ranks, AdamW, budget {budget}", "",
             f"`python bench/distributed_gpt.py --budget {budget}{flag}`. Units: `{units or 'blocks.*'}`; the root "
             "holds the rest (the tied embedding/head).", "",
             "| rank | module | losses | all-gathers per step | predicted peak | measured peak | budget |",
             "|---|---|---|---|---|---|---|"]
    for rank, r in enumerate(results):
        for name, predicted in (("unplanned", r["baseline"]), ("planned", r["predicted"])):
            run = r[name]
            lines.append(f"| {rank} | {name} | {', '.join(f'{x:.6f}' for x in run['losses'])} | {run['all_gathers']} "
                         f"| {format_bytes(predicted)} | {format_bytes(run['peak'])} | "
                         f"{format_bytes(r['budget']) if name == 'planned' else '-'} |")
    lines.append(f"\nSegments (module paths): {results[0]['segments']}")
    text = "\n".join(lines) + "\n"
    with open(ROOT / "bench" / "results" / "distributed.md", "a") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
