"""torchtitan's own Llama 3 debug model on 2 FSDP2 ranks (gloo, CPU), sharded by torchtitan's
``apply_fsdp_to_decoder`` and checkpointed by torchtitan's full activation checkpointing (``FullAC``), against
ckplan's plan made on rank 0 (``plan_on_rank0``) at that job's per-rank peak, sharded the same way. Peaks are read
at the allocator (``rank_peak_bytes``) in steps 2-4 (median), AdamW; losses of 4 steps.

Two changes to torchtitan's job, both for this CPU: the inner attention is torchtitan's own
``ScaledDotProductAttention`` (its language models take FlexAttention only, which has no CPU backward; every row is
one document, so block-causal is causal), and each FSDP module sums its gradients (``set_force_sum_reduction_for_
comms``: gloo has no ``PREMUL_SUM``).

    pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3 tyro einops torch_checkpointing triton
    python bench/torchtitan_fsdp.py            # about a minute on 2 cores

Prints a markdown table (``bench/results/distributed.md`` holds one).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from test_distributed import _init, _train, finish_rank, run_ranks  # noqa: E402

from planner.common.budget import format_bytes  # noqa: E402
from planner.distributed import plan_on_rank0  # noqa: E402

ROWS, TOKENS, VOCAB = 2, 512, 2048
UNITS = ["tok_embeddings", "layers.*"]
"""torchtitan's units: the embedding, each block; the final norm and the head stay gathered (the root here)."""


def build() -> torch.nn.Module:
    """torchtitan's Llama 3 ``debugmodel`` (6 blocks of width 256) with its SDPA inner attention."""
    import torchtitan.models.common.config_utils as config_utils
    import torchtitan.models.llama3 as llama3
    from torchtitan.models.common.attention import ScaledDotProductAttention

    llama3.get_attention_config = lambda backend: ScaledDotProductAttention.Config()
    torch.manual_seed(0)
    model = llama3._debugmodel("sdpa").build()
    assert config_utils  # imported for the module torchtitan reads its attention from
    with torch.no_grad():
        model.init_states()
    return model


def loss_of(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.flatten())


def shard(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    apply_fsdp_to_decoder(model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32, pp_enabled=False)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    return model


def worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    from torchtitan.distributed.activation_checkpoint import FullAC

    _init(rank, world_size, port)
    tokens = torch.randint(0, VOCAB, (ROWS, TOKENS), generator=torch.Generator().manual_seed(1 + rank))
    full = build()
    FullAC(FullAC.Config()).apply(full)
    result = {"full": _train(full, shard(full), tokens, loss_of=loss_of)}
    plan = plan_on_rank0(build(), result["full"]["peak"], inputs=(tokens,), optimizer="adamw", keep_output=False,
                         units=UNITS, loss_fn=lambda out: F.cross_entropy(out.flatten(0, 1).float(), tokens.flatten()))
    result.update(budget=plan.budget_bytes, predicted=plan.predicted_peak_bytes, overhead=plan.predicted_overhead,
                  segments=len(plan.segments), planned=_train(plan.module, shard(plan.module), tokens, loss_of=loss_of))
    finish_rank(out_dir, rank, result)


def main() -> None:
    with tempfile.TemporaryDirectory() as out:
        ranks = run_ranks(worker, Path(out), timeout_s=900)
    print(f"Budget: rank 0's measured peak under full AC, {format_bytes(ranks[0]['budget'])}; ckplan's plan: "
          f"{ranks[0]['segments']} segments, +{100 * ranks[0]['overhead']:.1f}% predicted re-run.\n")
    print("| rank | job | losses (4 AdamW steps) | predicted peak | measured peak | budget |")
    print("|---|---|---|---|---|---|")
    for rank, r in enumerate(ranks):
        for name, run, predicted, budget in (("torchtitan full AC", r["full"], None, None),
                                             ("ckplan plan", r["planned"], r["predicted"], r["budget"])):
            losses = ", ".join(f"{x:.6f}" for x in run["losses"])
            print(f"| {rank} | {name} | {losses} | {format_bytes(predicted) if predicted else '-'} | "
                  f"{format_bytes(run['peak'])} | {format_bytes(budget) if budget else '-'} |")


if __name__ == "__main__":
    main()
