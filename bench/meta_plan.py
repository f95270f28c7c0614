"""Plan a model too big for this machine: a ~1.3B-parameter Qwen2 decoder on the meta device.

    python bench/meta_plan.py                      # writes bench/results/meta_plan.md
    python bench/meta_plan.py --layers 2 --out -   # a quick run, printed only

The model is built from a config under ``torch.device("meta")`` (random-weight architecture,
nothing downloaded, nothing allocated), with meta inputs of batch 8 x sequence 2048, and
planned for ``device="h100"`` with a 60GB budget: capture (torch.export), the memory pass on
meta tensors with roofline times, regions, the solver, and the rewrite. The bar it checks:
under 2 minutes and under 4 GiB of resident memory on a 2-core CPU machine.
"""

from __future__ import annotations

import argparse
import platform
import resource
import sys
import time
from pathlib import Path

import torch
import transformers

import planner
from planner.common.budget import format_bytes

ROOT = Path(__file__).resolve().parent.parent


def build(args: argparse.Namespace) -> tuple[torch.nn.Module, dict]:
    config = transformers.Qwen2Config(
        vocab_size=32000, hidden_size=2048, intermediate_size=5504, num_hidden_layers=args.layers,
        num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=args.seq,
        tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa")
    with torch.device("meta"):
        model = transformers.Qwen2ForCausalLM(config).to(getattr(torch, args.dtype))
        ids = torch.randint(0, config.vocab_size, (args.batch, args.seq))
    return model, {"input_ids": ids, "labels": ids, "use_cache": False}


def rss_gib() -> float:
    """Peak resident memory of this process so far, GiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="h100")
    p.add_argument("--budget", default="60GB")
    p.add_argument("--time-limit", type=float, default=60.0, help="solver time limit, s")
    p.add_argument("--out", default=str(ROOT / "bench/results/meta_plan.md"), help="markdown file; - for none")
    args = p.parse_args()

    stamps: dict[str, float] = {}
    start = time.perf_counter()
    model, inputs = build(args)
    stamps["build"] = time.perf_counter()
    params = sum(p.numel() for p in model.parameters())

    def stage(name: str) -> None:
        stamps[name] = time.perf_counter()
        print(f"[{stamps[name] - start:6.1f} s, RSS {rss_gib():.2f} GiB] {name}", file=sys.stderr, flush=True)

    prepared = planner.prepare(model, inputs=inputs, device=args.device, progress=stage)
    stamps["regions"] = time.perf_counter()
    plan = planner.plan_for(prepared, args.budget, time_limit_s=args.time_limit, progress=stage)
    stamps["done"] = time.perf_counter()
    total, peak_rss = stamps["done"] - start, rss_gib()
    timings = [("build the model and inputs on meta", stamps["build"] - start),
               ("capture (torch.export)", stamps["profile"] - stamps["capture"]),
               ("profile: meta memory pass + roofline", stamps["regions"] - stamps["profile"]),
               ("solve", stamps["rewrite"] - stamps["solve"]),
               ("rewrite", stamps["done"] - stamps["rewrite"])]
    prof = prepared.profile
    lines = [
        "# Planning a model too big for this machine (meta device)",
        "",
        f"`python bench/meta_plan.py{' ' + ' '.join(sys.argv[1:]) if sys.argv[1:] else ''}` on "
        f"{platform.machine()} with {torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"transformers {transformers.__version__}.",
        "",
        f"- model: Qwen2ForCausalLM, {args.layers} layers, hidden 2048, intermediate 5504, 16 heads, vocab 32000, "
        f"{params / 1e9:.2f}B parameters in {args.dtype}, built under `torch.device(\"meta\")` (no weights)",
        f"- inputs: batch {args.batch} x sequence {args.seq} (meta), loss = the model's own `output.loss`",
        f"- planned for `device=\"{args.device}\"` with budget `{args.budget}`, "
        f"solver time limit {args.time_limit:g} s",
        f"- graph: {len(prof.nodes)} nodes ({prepared.captured.method.label}), {len(prof.storages)} storages, "
        f"{len(prepared.regions.starts)} chunks",
        "",
        "| | |",
        "|---|---|",
        f"| wall time, build to plan | **{total:.1f} s** (target < 120 s) |",
        f"| peak RSS | **{peak_rss:.2f} GiB** (target < 4 GiB) |",
        *(f"| {name} | {dt:.1f} s |" for name, dt in timings),
        f"| un-checkpointed peak (predicted) | {format_bytes(plan.baseline_peak_bytes)} |",
        f"| planned peak (predicted) | {format_bytes(plan.predicted_peak_bytes)} "
        f"≤ {format_bytes(plan.budget_bytes)} |",
        f"| predicted step on {args.device} (roofline) | {plan.step_ms:.0f} ms, "
        f"+{100 * plan.predicted_overhead:.1f}% recompute |",
        f"| segments | {len(plan.segments)}, solver {plan.solver_status} in {plan.solve_time_s:.1f} s |",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out != "-":
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
