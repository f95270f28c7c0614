"""Llama-3.1-8B and -70B shapes on the meta device, planned for one rank of an FSDP2 job on H100s.

    python bench/large_models.py                     # both shapes, writes bench/results/large_models.md
    python bench/large_models.py --shapes 8b --out -  # one shape, printed only

Each model is built from a config under ``torch.device("meta")`` (nothing downloaded, nothing allocated),
with a batch of 1 x 8192 tokens, bf16 mixed precision (FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``), AdamW, FSDP over 8 ranks (8B), FSDP 8 x TP 8 (70B) and FSDP 16 x TP 8 (405B: tensor
parallelism from the config's ``base_model_tp_plan``, ``planner.distributed.tensor``), ``device="h100"``, the logits dropped
before backward (``keep_output=False``, as torchtitan's train loop). Each shape is prepared once (capture on
meta, the memory replay on meta tensors, roofline times), then planned with the hand policies in the same
cost model (``planner.solve.baselines``: every decoder layer, as torchtitan's full activation checkpointing
and Hugging Face's gradient checkpointing do; torchtitan's default op-level selective policy, ``op_sac``),
ckplan at each policy's own peak, and ckplan at a few budgets, all checkpointing only (``offload=False``: host
offload, on by default for a GPU spec, is weighed in ``bench/offload.py``). Reported: predicted per-rank peak, re-run time
and overhead of each, planning time and the process's peak resident memory (each shape in a fresh process,
so that RSS is its own).
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {
    "8b": dict(layers=32, hidden=4096, heads=32, kv=8, ffn=14336, ranks=8, tp=1, budgets=["70GB", "50GB", "40GB"]),
    "70b": dict(layers=80, hidden=8192, heads=64, kv=8, ffn=28672, ranks=8, tp=8, budgets=["70GB", "50GB", "40GB"]),
    "405b": dict(layers=126, hidden=16384, heads=128, kv=8, ffn=53248, ranks=16, tp=8,
                 budgets=["120GB", "100GB", "80GB"]),
}
"""Llama-3.1's shapes; ``ranks`` data-parallel (FSDP2) ranks, each layer split over ``tp`` tensor-parallel ones, as
torchtitan trains 70B and 405B."""
VOCAB, TOKENS = 128256, 8192


def build(shape: dict) -> tuple[torch.nn.Module, dict]:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=shape["hidden"], intermediate_size=shape["ffn"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"], num_key_value_heads=shape["kv"],
        max_position_embeddings=TOKENS, rope_theta=500000.0, tie_word_embeddings=False, use_cache=False,
        attn_implementation="sdpa")
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
        ids = torch.randint(0, VOCAB, (1, TOKENS))
    return model, {"input_ids": ids, "labels": ids}


def rss_gib() -> float:
    """Peak resident memory of this process so far, GiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def one_shape(name: str, time_limit_s: float) -> dict:
    """Plans one shape (run in a fresh process); its rows and timings as a dict."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import planner
    from planner.errors import InfeasibleBudget
    from planner.pipeline import plan_from_solution
    from planner.planning.prepared import chunked
    from planner.solve.baselines import every_block, op_sac

    shape = SHAPES[name]
    began = time.perf_counter()
    model, batch = build(shape)
    params = sum(p.numel() for p in model.parameters())
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    prepared = planner.prepare(model, inputs=batch, device="h100", world_size=shape["ranks"], optimizer="adamw",
                               mixed_precision=mp, time_limit_s=time_limit_s, keep_output=False,
                               tensor_parallel=shape["tp"])
    prepared_s = time.perf_counter() - began
    rows = [("no checkpointing", prepared.baseline.peak_bytes, 0.0, 0.0, "")]
    wide = chunked(prepared, 4 * shape["layers"])  # every layer edge a cut position
    for label, policy in (("every decoder layer (torchtitan full AC, HF checkpointing)", every_block),
                          ("torchtitan's default selective policy (op_sac)", op_sac)):
        fixed = policy(wide.memory, 0)
        plan = plan_from_solution(wide, fixed, prepared.baseline.peak_bytes)
        rows.append((label, plan.predicted_peak_bytes, plan.recompute_ms, plan.predicted_overhead,
                     f"{len(plan.segments)} segments, {sum(len(s.saved_ops) for s in plan.segments)} ops kept"))
        start = time.perf_counter()
        ours = planner.plan_for(prepared, plan.predicted_peak_bytes, offload=False)
        rows.append(("ckplan at that peak", ours.predicted_peak_bytes, ours.recompute_ms, ours.predicted_overhead,
                     f"re-runs {ours.recompute_ms / plan.recompute_ms:.2f}x the policy; {len(ours.segments)} segments, "
                     f"{sum(len(s.saved_ops) for s in ours.segments)} ops kept, {ours.solver_status} in "
                     f"{time.perf_counter() - start:.1f} s"))
    solves = []
    for budget in shape["budgets"]:
        start = time.perf_counter()
        try:
            plan = planner.plan_for(prepared, budget, offload=False)
            rows.append((f"ckplan at {budget}", plan.predicted_peak_bytes, plan.recompute_ms, plan.predicted_overhead,
                         f"{len(plan.segments)} segments, {sum(len(s.saved_ops) for s in plan.segments)} ops kept, "
                         f"{plan.solver_status} in {plan.solve_time_s:.1f} s"))
        except InfeasibleBudget as exc:
            rows.append((f"ckplan at {budget}", None, None, None, f"no plan: {exc}".split("; ")[0]))
        solves.append(time.perf_counter() - start)
    return {"name": name, "params": params, "prepare_s": prepared_s, "solve_s": solves,
            "first_plan_s": prepared_s + solves[0], "rss_gib": rss_gib(), "rows": rows,
            "fixed": prepared.memory.param_bytes, "nodes": len(prepared.profile.nodes)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--time-limit", type=float, default=30.0, help="solve time limit per budget, s")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(ROOT / "bench/results/large_models.md"), help="markdown file; - for none")
    args = p.parse_args()
    if args.one:
        print(json.dumps(one_shape(args.one, args.time_limit)))
        return
    results = []
    for name in args.shapes:
        done = subprocess.run([sys.executable, __file__, "--one", name, "--time-limit", str(args.time_limit)],
                              capture_output=True, text=True, check=True)
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    text = report(results, args)
    print(text)
    if args.out != "-":
        Path(args.out).write_text(text)


def gib(value: int | None) -> str:
    return "" if value is None else f"{value / 2**30:.2f} GiB"


def report(results: list[dict], args: argparse.Namespace) -> str:
    lines = ["# Llama-3.1 shapes on meta, planned for one rank of FSDP2 (x TP) on H100s", "",
             f"`python bench/large_models.py --shapes {' '.join(args.shapes)}` on {platform.machine()}, torch "
             f"{torch.__version__}, {torch.get_num_threads()} threads. Batch 1 x {TOKENS} tokens, bf16 mixed "
             "precision (MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)), AdamW, "
             "`device=\"h100\"`: memory from the meta replay, times from the H100 roofline. Peaks are per rank "
             "and predicted; the logits are dropped before backward, as torchtitan's loop does. \"ckplan at that "
             "peak\" plans for the policy above at its own predicted peak, in the same cost model.", ""]
    for r in results:
        shape = SHAPES[r["name"]]
        parallel = f"FSDP {shape['ranks']} x TP {shape['tp']}" if shape["tp"] > 1 else f"FSDP over {shape['ranks']} ranks"
        lines += [f"## {r['name'].upper()}: {r['params'] / 1e9:.2f}B parameters, {parallel}",
                  "", f"{r['nodes']} graph nodes. Prepare (capture + memory replay) {r['prepare_s']:.1f} s; first plan "
                  f"after {r['first_plan_s']:.1f} s; each budget's solve "
                  f"{', '.join(f'{s:.1f} s' for s in r['solve_s'])}; peak RSS {r['rss_gib']:.2f} GiB. Resident per "
                  f"rank: {gib(r['fixed'])} of parameter shards.", "",
                  "| plan | predicted peak per rank | re-run per step | predicted overhead | |",
                  "|---|---|---|---|---|"]
        for label, peak, rerun, overhead, note in r["rows"]:
            lines.append(f"| {label} | {gib(peak)} | {'' if rerun is None else f'{rerun:.1f} ms'} | "
                         f"{'' if overhead is None else f'+{100 * overhead:.1f}%'} | {note} |")
        lines.append("")
    return "\n".join(lines) + PUBLIC


PUBLIC = """
## Beside torchtitan's published peaks (Llama 3 8B, 8 x H100, FSDP2, bf16, AdamW, 8192 tokens)

References, not targets: they were measured on GPUs with torchtitan's own model code, and their batch
sizes are not all stated.

| torchtitan | logged peak per GPU | ckplan's prediction for the closest plan here |
|---|---|---|
| full activation checkpointing (pytorch/torchtitan PR 3429) | 32.07 GiB | every decoder layer: 27.63 GiB (the logits dropped before backward) |
| default selective policy (PR 3429) | 52.44 GiB | op_sac, the same policy in ckplan's cost model: 39.16 GiB; ckplan at that peak re-runs 0.96x of it |
| local batch 2, selective op checkpointing (benchmarks/llama3_h100_202412_torchtitan.md) | 82.4 GiB | not planned here: batch 1 |

What can separate a logged peak from a prediction of live tensors, which this bench does not model:
- the caching allocator's reserve: torchtitan logs the allocator's reserved peak, which rounds every block
  up and keeps freed blocks (typically 5-15% above the live tensors);
- NCCL's communication buffers and the CUDA context, outside the allocator's tensors (hundreds of MiB);
- the loop: torchtitan deletes the logits before backward (as these rows do: keep_output=False), and may compute
  the loss in chunks; here the fp32 logits of 8192 x 128256 tokens are 3.9 GiB;
- the model code: torchtitan's Llama fuses or orders ops differently from Hugging Face's (which upcasts
  RMSNorm and the logits to fp32);
- times: these are H100 roofline estimates, not measurements; overheads are the ratio of estimated
  recompute to the estimated step, not a measured slowdown.
"""


if __name__ == "__main__":
    main()
