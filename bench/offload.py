"""Offload on Llama-3.1-8B: one rank of FSDP over 8 GPUs, planned on meta for H100, H200 and GH200.

    python bench/offload.py                                  # every device and length, writes bench/results/offload.md
    python bench/offload.py --devices h100 --tokens 32768 --out -

The model is built from its config on the meta device (``bench/large_models.py``: nothing downloaded, nothing
allocated), one sequence of 8k, 32k or 128k tokens, bf16 mixed precision, AdamW, the logits dropped before backward
(torchtitan's loop). For each device and length, at the predicted peak of torchtitan's full activation
checkpointing (every decoder layer) and of its default op-level policy (``op_sac``): the policy itself, ckplan
without offload, and ckplan with offload (the host link of the device spec: 53 GB/s each way on H100/H200 over
PCIe, 170 GB/s out and 410 GB/s back on GH200), as the ranks of one host share it by default: each rank's link at
most an equal share of the host memory's bandwidth, and pinned memory up to half the host's memory split among its
ranks (8 per DGX H100/H200 host, 1 per GH200 superchip). Step times are predicted: the roofline's un-checkpointed step plus
the plan's re-runs plus the copy time the compute does not hide (``docs/offload.md``). Each device and length runs
in a fresh process.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import large_models  # noqa: E402  (the same Llama shapes and builder)

DEVICES = ("h100", "h200", "gh200")
LENGTHS = (8192, 32768, 131072)


def one(device: str, tokens: int, time_limit_s: float) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import planner
    from planner.pipeline import plan_from_solution
    from planner.planning.offloading import host_of, offload_limits
    from planner.planning.prepared import chunked
    from planner.solve.baselines import every_block, op_sac

    large_models.TOKENS = tokens
    shape = large_models.SHAPES["8b"]
    began = time.perf_counter()
    model, batch = large_models.build(shape)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    prepared = planner.prepare(model, inputs=batch, device=device, world_size=shape["ranks"], optimizer="adamw",
                               mixed_precision=mp, time_limit_s=time_limit_s, keep_output=False)
    prepare_s = time.perf_counter() - began
    step = prepared.profile.step_ms
    wide = chunked(prepared, 4 * shape["layers"])
    rows = []

    def row(label: str, plan, solve_s: float | None = None) -> dict:
        off = plan.offload
        return {"label": label, "peak": plan.predicted_peak_bytes, "rerun_ms": plan.recompute_ms,
                "step_ms": step * (1 + plan.predicted_overhead), "offloaded": off.offloaded_bytes if off else 0,
                "exposed_ms": off.exposed_ms if off else 0.0, "d2h": off.d2h_busy_ms / off.forward_ms if off else 0.0,
                "h2d": off.h2d_busy_ms / off.backward_ms if off else 0.0, "solve_s": solve_s,
                "bound_ms": plan.recompute_bound_ms if off else None}

    for name, policy in (("full AC (every decoder layer)", every_block), ("op-SAC (torchtitan's default policy)",
                                                                           op_sac)):
        fixed = plan_from_solution(wide, policy(wide.memory, 0), prepared.baseline.peak_bytes)
        rows.append(row(name, fixed))
        for offload in (False, True):
            start = time.perf_counter()
            ours = planner.plan_for(prepared, fixed.predicted_peak_bytes, offload=offload)
            rows.append(row(f"ckplan at that peak, {'with' if offload else 'without'} offload", ours,
                            time.perf_counter() - start))
    fwd_ms = sum(n.fwd_ms for n in prepared.profile.nodes)
    limits = offload_limits(prepared, replace(prepared.options, offload=True))
    host = host_of(prepared, prepared.options)
    link = limits.link.d2h_bytes_per_us / 1e3  # GB/s, each rank's share
    return {"device": device, "tokens": tokens, "prepare_s": prepare_s, "step_ms": step, "fwd_ms": fwd_ms,
            "window_gib": link * 1e9 * fwd_ms / 1e3 / 2**30, "d2h_gb_per_s": link,
            "h2d_gb_per_s": limits.link.h2d_bytes_per_us / 1e3, "alone_gb_per_s": prepared.profile.d2h_gb_per_s,
            "ranks_per_host": host.ranks, "host_gb_per_s": host.bandwidth_gb_per_s,
            "host_budget": limits.host_budget_bytes, "none_peak": prepared.baseline.peak_bytes, "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", nargs="+", default=list(DEVICES), choices=DEVICES)
    p.add_argument("--tokens", nargs="+", type=int, default=list(LENGTHS))
    p.add_argument("--time-limit", type=float, default=20.0, help="solve time limit per plan, s")
    p.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(ROOT / "bench/results/offload.md"), help="markdown file; - for none")
    args = p.parse_args()
    if args.one:
        print(json.dumps(one(args.one[0], int(args.one[1]), args.time_limit)))
        return
    results = []
    for device in args.devices:
        for tokens in args.tokens:
            done = subprocess.run([sys.executable, __file__, "--one", device, str(tokens), "--time-limit",
                                   str(args.time_limit)], capture_output=True, text=True, check=True)
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"{device} {tokens}: done", file=sys.stderr)
    text = report(results, args)
    print(text)
    if args.out != "-":
        Path(args.out).write_text(text)


def gib(value: float) -> str:
    return f"{value / 2**30:.2f} GiB"


def report(results: list[dict], args: argparse.Namespace) -> str:
    lines = ["# Offload on Llama-3.1-8B, one rank of FSDP over 8 GPUs (meta, predicted)", "",
             f"`python bench/offload.py --devices {' '.join(args.devices)} --tokens "
             f"{' '.join(map(str, args.tokens))}` on {platform.machine()}, torch {torch.__version__}, solve time limit "
             f"{args.time_limit:.0f} s per plan. One sequence per step, bf16 mixed precision, AdamW, the logits "
             "dropped before backward. Memory from the meta replay (the Hugging Face Llama code as eager code runs it: SDPA's causal kernel, no mask), times "
             "from the device spec's roofline and host link: every figure is a prediction, none is measured on a GPU. "
             "Step time = the un-checkpointed step + re-runs + the copy time the compute does not hide. "
             "\"vs full AC\": step time saved against full activation checkpointing's own step. The host as its "
             "ranks share it (the default `ranks_per_host`: the job's 8 ranks, up to the spec's `gpus_per_host`): "
             "each rank's link at most an equal share of the host memory's peak bandwidth, pinned memory up to half "
             "of the host's memory split among its ranks (the default `host_budget`). \"bound\": the least re-run "
             "time any plan that fits the peak with offloads can have (proven: such a plan, without its offloads, "
             "fits the peak plus what the link carries out in the forward or the host budget holds, and the solver "
             "bounds every plan there), and in brackets how much of the un-checkpointed step ckplan's re-runs and "
             "exposed copies may spend above it.", ""]
    for r in results:
        full = r["rows"][0]["step_ms"]
        lines += [f"## {r['device'].upper()}, {r['tokens'] // 1024}k tokens", "",
                  f"Un-checkpointed: {gib(r['none_peak'])} per rank, {r['step_ms']:.0f} ms a step. "
                  f"{r['ranks_per_host']} rank{'s' if r['ranks_per_host'] > 1 else ''} per host, whose memory moves "
                  f"{r['host_gb_per_s']:g} GB/s at peak ({r['host_gb_per_s'] / r['ranks_per_host']:.1f} GB/s a "
                  f"rank); each rank's link {r['d2h_gb_per_s']:.0f} GB/s out, {r['h2d_gb_per_s']:.0f} GB/s back "
                  f"(alone: {r['alone_gb_per_s']:.0f} out); pinned host memory up to {gib(r['host_budget'])} a rank. "
                  f"The forward ({r['fwd_ms']:.0f} ms) can carry {r['window_gib']:.1f} GiB to the host while it "
                  "computes.", "",
                  "| plan | peak per rank | re-run | step | vs full AC | offloaded | link busy out / back | "
                  "copies exposed | bound | solve |", "|---|---|---|---|---|---|---|---|---|---|"]
        for row in r["rows"]:
            saved = 1 - row["step_ms"] / full
            off = gib(row["offloaded"]) if row["offloaded"] else ""
            busy = f"{100 * row['d2h']:.0f}% / {100 * row['h2d']:.0f}%" if row["offloaded"] else ""
            exposed = f"{row['exposed_ms']:.1f} ms" if row["offloaded"] else ""
            solve = f"{row['solve_s']:.1f} s" if row["solve_s"] is not None else ""
            bound = "" if row.get("bound_ms") is None else \
                f"{row['bound_ms']:.0f} ms ({100 * (row['rerun_ms'] + row['exposed_ms'] - row['bound_ms']) / r['step_ms']:.1f}%)"
            lines.append(f"| {row['label']} | {gib(row['peak'])} | {row['rerun_ms']:.0f} ms | {row['step_ms']:.0f} ms | "
                         f"{100 * saved:+.1f}% | {off} | {busy} | {exposed} | {bound} | {solve} |")
        lines.append("")
    return "\n".join(lines) + PUBLIC


PUBLIC = """
## Beside torchtitan's reported figures

References, not targets (measured on GPUs with torchtitan's own Llama code; ckplan's rows are predictions for
Hugging Face's):
- torchtitan PR 4636 (`auto_perf_maxing`, a two-level ILP with a copy-engine window): +5.2-5.5% tokens/s over full
  activation checkpointing at equal peak, about 8.6 GiB offloaded.
- torchtitan PR 3881's estimator: on H100 over PCIe only about 1.8 GiB (Llama 3) to 3.3 GiB (Qwen3) can leave within
  the forward window at its settings; the "can carry" figure above is the same bound for this step.
"""


if __name__ == "__main__":
    main()
