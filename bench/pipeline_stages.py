"""Llama-3.1-70B and -405B as torchtitan trains them with pipeline parallelism, planned stage by stage on meta.

    python bench/pipeline_stages.py                     # both shapes, writes bench/results/pipeline_stages.md
    python bench/pipeline_stages.py --shapes 70b --out -  # one shape, printed only

70B: PP 4 x FSDP 8 x TP 8, 1F1B, 8 microbatches; 405B: PP 8 x FSDP 8 x TP 8, 1F1B, 16 microbatches. Each microbatch
is 1 x 8192 tokens; bf16 mixed precision (FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``),
AdamW, ``device="h100"`` (memory from the meta replay, times from the H100 roofline). The model is a Hugging Face
Llama split by its decoder layers as torchtitan splits its own (``examples/llama_pipeline.py``: the embedding on the
first stage, the norm and the head on the last, which computes the loss and returns no outputs,
``return_outputs=False``). Each kind of stage (first, middle, last) is prepared once and planned for every rank it
sits at (``pipeline_rank``): the first stage holds the most microbatches in flight, the last one.

Compared at the largest stage peak of torchtitan's uniform full activation checkpointing (every decoder layer, on
every stage): each stage under that policy, under torchtitan's default op-level selective policy (``op_sac``), and
ckplan's plan for the stage at that budget. Reported per stage: its predicted peak (every microbatch in flight,
the gradients accumulating, FSDP's gathered units, the pipeline's buffers) and its re-run time per microbatch; per
policy: the re-run time of a step (every stage, every microbatch) and the predicted step, which the slowest stage
sets (1F1B: ``microbatches + stages - 1`` slots of its forward, backward and re-run).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
from large_models import gib, rss_gib  # bench/ is on the path when run as a script

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
SHAPES = {
    "70b": dict(layers=80, hidden=8192, heads=64, kv=8, ffn=28672, pp=4, dp=8, tp=8, microbatches=8, limit_s=10.0),
    "405b": dict(layers=126, hidden=16384, heads=128, kv=8, ffn=53248, pp=8, dp=8, tp=8, microbatches=16,
                 limit_s=6.0),
}
"""Llama-3.1's shapes and the 3D layout torchtitan trains them with: ``pp`` stages, ``dp`` FSDP2 ranks, ``tp``
tensor-parallel ranks; ``limit_s``, each stage's solve time limit, so that every stage is planned within a minute."""
VOCAB, TOKENS = 128256, 8192
OFFLOAD_LIMIT_S = 30.0
"""Each stage's solve time limit with offload (the option's default): its plan at the budget, then plans for a few
budgets above it offloaded down, each a search of several solves."""


def stage_of(shape: dict, place: str, layers: int):
    """One stage of the shape on meta, and its microbatch and loss."""
    import llama_pipeline
    import torch.nn.functional as F
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=shape["hidden"], intermediate_size=shape["ffn"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"], num_key_value_heads=shape["kv"],
        max_position_embeddings=TOKENS, rope_theta=500000.0, tie_word_embeddings=False, use_cache=False,
        attn_implementation="sdpa")
    with torch.device("meta"):
        stage = llama_pipeline.LlamaStage(llama_pipeline.stage_config(config, place, layers))
        labels = torch.randint(0, VOCAB, (1, TOKENS))
        x = (torch.randint(0, VOCAB, (1, TOKENS)) if place == llama_pipeline.FIRST
             else torch.randn(1, TOKENS, shape["hidden"], dtype=torch.bfloat16, requires_grad=True))
    loss = ((lambda logits: F.cross_entropy(logits.float().view(-1, VOCAB), labels.view(-1)))
            if place == llama_pipeline.LAST else None)
    return stage, (x,), loss


def one_shape(name: str, time_limit_s: float) -> dict:
    """Plans every stage of one shape (run in a fresh process, so that its RSS is its own)."""
    import llama_pipeline
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import planner
    from planner.memory.pipeline import Pipeline, Schedule
    from planner.planning.pipelined import held_by_stage, received_gradient, unplanned_stage_peak
    from planner.planning.prepared import chunked
    from planner.solve.baselines import every_block, op_sac

    shape = SHAPES[name]
    pp, m = shape["pp"], shape["microbatches"]
    pipe = Pipeline(schedule=Schedule.ONE_F_ONE_B, stages=pp, microbatches=m)
    counts = llama_pipeline.layer_counts(shape["layers"], pp)
    places = [llama_pipeline.FIRST, *[llama_pipeline.MIDDLE] * (pp - 2), llama_pipeline.LAST]
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    began = time.perf_counter()
    prepared: dict = {}
    for place, count in zip(places, counts):
        if (place, count) not in prepared:
            stage, inputs, loss = stage_of(shape, place, count)
            prepared[place, count] = planner.prepare(
                stage, inputs=inputs, loss_fn=loss, device="h100", world_size=shape["dp"], optimizer="adamw",
                mixed_precision=mp, tensor_parallel=shape["tp"], keep_output=place != llama_pipeline.LAST,
                pipeline=pipe, follow_batch=False, time_limit_s=time_limit_s)
    prepare_s = time.perf_counter() - began
    stages = []
    for rank, (place, count) in enumerate(zip(places, counts)):
        ready = received_gradient(prepared[place, count], pipe, rank)  # as plan_for reads a stage
        baseline = unplanned_stage_peak(ready, pipe, rank)
        wide = chunked(ready, 4 * count)  # every layer edge a cut position
        policies = {}
        for label, policy in (("full", every_block), ("op_sac", op_sac)):
            fixed = policy(wide.memory, 0)
            held = held_by_stage(ready, (wide, fixed), pipe, rank, baseline)
            policies[label] = {"peak": held.peak_bytes, "rerun_ms": fixed.recompute_us / 1000}
        stages.append({"rank": rank, "place": place, "layers": count, "baseline": baseline,
                       "step_ms": ready.profile.step_ms, "policies": policies,
                       "nodes": len(ready.profile.nodes)})
    budget = max(s["policies"]["full"]["peak"] for s in stages)
    plan_s = {}
    for key, offload, limit in (("ckplan", False, time_limit_s), ("offload", None, OFFLOAD_LIMIT_S)):
        planned_began = time.perf_counter()  # offload None: where it pays, the default
        for s in stages:
            start = time.perf_counter()
            plan = planner.plan_for(prepared[s["place"], s["layers"]], budget, pipeline_rank=s["rank"],
                                    time_limit_s=limit, offload=offload)
            s["policies"][key] = {"peak": plan.pipeline_stage.peak_bytes, "rerun_ms": plan.recompute_ms,
                                  "exposed_ms": plan.offload.exposed_ms if plan.offload else 0.0,
                                  "host": plan.pipeline_stage.host_bytes, "segments": len(plan.segments),
                                  "status": str(plan.solver_status), "solve_s": time.perf_counter() - start}
        plan_s[key] = time.perf_counter() - planned_began
    return {"name": name, "budget": budget, "stages": stages, "prepare_s": prepare_s, "plan_s": plan_s,
            "limit_s": time_limit_s, "rss_gib": rss_gib(), "kinds": len(prepared)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--time-limit", type=float, help="solve time limit per stage, s (default: the shape's limit_s)")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(ROOT / "bench/results/pipeline_stages.md"), help="markdown file; - for none")
    args = p.parse_args()
    if args.one:
        print(json.dumps(one_shape(args.one, args.time_limit)))
        return
    results = []
    for name in args.shapes:
        limit = args.time_limit or SHAPES[name]["limit_s"]
        done = subprocess.run([sys.executable, __file__, "--one", name, "--time-limit", str(limit)],
                              capture_output=True, text=True)
        if done.returncode:
            sys.exit(done.stderr[-4000:])
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    text = report(results, args)
    print(text)
    if args.out != "-":
        Path(args.out).write_text(text)


POLICIES = (("full", "uniform full AC (every decoder layer, torchtitan's `full`)"),
            ("op_sac", "uniform op-SAC (torchtitan's default `selective`)"),
            ("ckplan", "ckplan, each stage planned for its place"),
            ("offload", "ckplan with offload (the default on a GPU)"))


def cost_ms(stage: dict, policy: str) -> float:
    """What a policy adds to one microbatch's step on the stage: its re-runs and the copies compute does not hide."""
    used = stage["policies"][policy]
    return used["rerun_ms"] + used.get("exposed_ms", 0.0)


def step_ms(stages: list[dict], policy: str, m: int) -> float:
    """1F1B's step: ``m + p - 1`` slots of the slowest stage's microbatch (forward, backward, re-runs and exposed
    copies)."""
    return (m + len(stages) - 1) * max(s["step_ms"] + cost_ms(s, policy) for s in stages)


def cell(stage: dict, policy: str) -> str:
    used = stage["policies"][policy]
    text = f"{gib(used['peak'])}, {used['rerun_ms']:.0f} ms"
    if used.get("host"):
        text += f" + {used['exposed_ms']:.0f} ms exposed copies, {gib(used['host'])} in host memory"
    return text


def report(results: list[dict], args: argparse.Namespace) -> str:
    lines = ["# Pipeline stages: Llama-3.1 70B and 405B as torchtitan trains them, planned per stage on meta", "",
             f"`python bench/pipeline_stages.py --shapes {' '.join(args.shapes)}` on {platform.machine()}, torch "
             f"{torch.__version__}, {torch.get_num_threads()} threads. Microbatches of 1 x {TOKENS} tokens, 1F1B, "
             "bf16 mixed precision (FSDP2, reduce in fp32), AdamW, `device=\"h100\"`: peaks per rank and "
             "predicted (memory from the meta replay, times from the H100 roofline). A Hugging Face Llama split by "
             "its decoder layers (`examples/llama_pipeline.py`); the last stage computes the loss and returns no "
             "outputs. Every policy is held to the largest stage peak of uniform full activation checkpointing.",
             ""]
    for r in results:
        shape = SHAPES[r["name"]]
        m, stages = shape["microbatches"], r["stages"]
        total = {key: m * sum(cost_ms(s, key) for s in stages) for key, _ in POLICIES}
        lines += [f"## {r['name'].upper()}: PP {shape['pp']} x FSDP {shape['dp']} x TP {shape['tp']}, {m} "
                  "microbatches", "",
                  f"Planning, build to every stage's plan: {r['prepare_s'] + r['plan_s']['ckplan']:.1f} s at "
                  f"{r['limit_s']:g} s per stage's solves ({r['kinds']} kinds "
                  f"of stage prepared in {r['prepare_s']:.1f} s, {len(stages)} stages planned in "
                  f"{r['plan_s']['ckplan']:.1f} s; with offload, at {OFFLOAD_LIMIT_S:g} s per stage, "
                  f"{r['plan_s']['offload']:.1f} s); peak RSS "
                  f"{r['rss_gib']:.2f} GiB. Budget: {gib(r['budget'])} per rank.",
                  "", "| stage | layers | in flight | un-checkpointed | " + " | ".join(
                      f"{label}: peak, re-run per microbatch" for _, label in POLICIES) + " |",
                  "|---|---|---|---|" + "---|" * len(POLICIES)]
        for s in stages:
            cells = [cell(s, key) for key, _ in POLICIES]
            lines.append(f"| {s['rank']} ({s['place']}) | {s['layers']} | "
                         f"{min(m, shape['pp'] - s['rank'])} | {gib(s['baseline'])} | " + " | ".join(cells) + " |")
        lines += ["", "| policy | largest stage peak | re-run (and exposed copies) per step, every stage | vs full AC "
                  "| predicted step |",
                  "|---|---|---|---|---|"]
        for key, label in POLICIES:
            peak = max(s["policies"][key]["peak"] for s in stages)
            lines.append(f"| {label} | {gib(peak)} | {total[key] / 1000:.2f} s | "
                         f"{100 * (total[key] / total['full'] - 1):+.0f}% | {step_ms(stages, key, m) / 1000:.2f} s |")
        for key, label in (("ckplan", "ckplan's stages"), ("offload", "With offload")):
            solves = ", ".join(f"{s['policies'][key]['segments']} segments {s['policies'][key]['status']} "
                               f"in {s['policies'][key]['solve_s']:.1f} s" for s in stages)
            lines += ["", f"{label}, first to last: {solves}."]
        lines.append("")
    return "\n".join(lines) + NOTES


NOTES = """
## Reading the tables

- Under 1F1B the first stage holds the most microbatches in flight, so a uniform policy sized for it leaves the
  later stages room they do not use; ckplan plans each stage for what it holds and fills that room, re-running
  less where fewer microbatches are in flight.
- The budget is the largest stage peak under uniform full checkpointing: on 70B the last stage (its head's
  logits, 1 x 8192 x 128256, with the loss's fp32 copy), on 405B the first (8 microbatches in flight).
- The step is set by the slowest stage: where that stage is already at the budget under full checkpointing (70B's
  last), per-stage plans save re-run time on the others, GPU time the bubble then idles, but hardly shorten the
  step; where the slowest stage has room (405B), the step shortens too.
- Uniform op-SAC does not fit this budget on either model (its row's peak is over it).
- With offload (the default where the host link runs beside compute: a GPU, or a GPU's spec), a stage's
  microbatches in flight, which wait from their forward to their backward while the others run, send part of what
  they keep to host memory: each stage then keeps more on the device and re-runs less. The host memory column is
  what the stage's microbatches in flight hold there together (a copy each), within the rank's share of the
  host's pinnable memory (half a DGX host's 2 TB, over its 8 GPUs). Its planning takes the option's default 30 s
  per stage: its plan at the budget, then plans for a few budgets above it, offloaded down.
- Everything is predicted: peaks from the meta replay of one rank's stage (FSDP units gathered through the
  microbatches, the accumulated fp32 gradients, the pipeline runtime's buffers), times from the H100 roofline.
  The memory model is measured on CPU against real gloo pipelines (`tests/test_pipeline.py`), not at this scale.
"""


if __name__ == "__main__":
    main()
