"""A Hugging Face Llama split into pipeline stages by its decoder layers, each stage planned for the microbatches
its schedule keeps in flight, and trained with ``torch.distributed.pipelining``'s 1F1B schedule:

    python -m torch.distributed.run --standalone --nproc_per_node 2 examples/llama_pipeline.py

``LlamaStage`` is one stage, split as torchtitan splits its own Llama: the embedding on the first stage, a run of
decoder layers on each, the final norm and the head on the last. Built from a config (``stage_config``), it plans
a stage of a model too big for this machine on the meta device, tensor parallelism included
(``tensor_parallel=``: the config's ``base_model_tp_plan`` names its projections); built from a model
(``split``), its stages share that model's parameters, so the pipeline trains the model itself.
"""

from __future__ import annotations

import copy
import os

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

FIRST, MIDDLE, LAST = "first", "middle", "last"
"""A stage's place (``config.pipeline_stage``): the first holds the embedding, the last the norm and the head."""


class LlamaStage(nn.Module):
    """One pipeline stage of a ``LlamaForCausalLM``: ``config.num_hidden_layers`` decoder layers, the embedding
    before them on the first stage (token ids in), the final norm and the head after them on the last (logits
    out); hidden states in and out between. Causal attention over the whole sequence, no padding mask."""

    def __init__(self, config: transformers.LlamaConfig) -> None:
        super().__init__()
        self.config = config
        place = config.pipeline_stage
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size) if place == FIRST else None
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps) if place == LAST else None
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False) if place == LAST else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(x) if self.embed_tokens is not None else x
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        rotary = self.rotary_emb(hidden, positions)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=None, position_embeddings=rotary, position_ids=positions)
        if self.lm_head is None or self.norm is None:
            return hidden
        return self.lm_head(self.norm(hidden))


def stage_config(config: transformers.LlamaConfig, place: str, layers: int) -> transformers.LlamaConfig:
    """``config`` for one stage: ``layers`` decoder layers at ``place`` (``FIRST``, ``MIDDLE`` or ``LAST``)."""
    local = copy.deepcopy(config)
    local.num_hidden_layers, local.pipeline_stage = layers, place
    return local


def layer_counts(layers: int, stages: int) -> list[int]:
    """Decoder layers per stage, as even as they split; the first and last stages (which also hold the embedding
    and the head) take the fewer where they do not split evenly."""
    base, extra = divmod(layers, stages)
    counts = [base] * stages
    middle = list(range(1, stages - 1)) or list(range(stages))
    for i in range(extra):
        counts[middle[i % len(middle)]] += 1
    return counts


def split(model: transformers.LlamaForCausalLM, stages: int) -> list[LlamaStage]:
    """``model`` as ``stages`` stage modules that share its parameters (built on meta, then given the model's own
    modules: nothing is copied)."""
    counts, start, out = layer_counts(model.config.num_hidden_layers, stages), 0, []
    for index, count in enumerate(counts):
        place = FIRST if index == 0 else LAST if index == stages - 1 else MIDDLE
        with torch.device("meta"):
            stage = LlamaStage(stage_config(model.config, place, count))
        stage.layers = nn.ModuleList(model.model.layers[start:start + count])
        stage.rotary_emb = model.model.rotary_emb
        if place == FIRST:
            stage.embed_tokens = model.model.embed_tokens
        if place == LAST:
            stage.norm, stage.lm_head = model.model.norm, model.lm_head
        out.append(stage)
        start += count
    return out


def small_llama() -> transformers.LlamaForCausalLM:
    """A small random Llama (nothing downloaded), its head untied from the embedding: they sit on two stages."""
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def loss_of(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy of ``logits`` for ``labels`` (already shifted)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


def main() -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from planner.distributed import plan_stages

    dist.init_process_group("gloo")
    rank, ranks, microbatches = dist.get_rank(), dist.get_world_size(), 4
    model = small_llama()
    tokens = torch.randint(0, model.config.vocab_size, (8, 129), generator=torch.Generator().manual_seed(1))
    ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    rows = len(ids) // microbatches
    stages = split(model, ranks)
    plans = plan_stages(stages, "80%", inputs=(ids[:rows],), pipeline=f"1f1b:{ranks}:{microbatches}",
                        loss_fn=lambda logits: loss_of(logits, labels[:rows]), follow_batch=False)
    plan = plans[rank]  # every rank plans every stage alike; each runs its own
    print(f"rank {rank}: {plan.summary().splitlines()[0]}", flush=True)
    stage = PipelineStage(plan.module, stage_index=rank, num_stages=ranks, device=torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=microbatches, loss_fn=loss_of)
    optimizer = torch.optim.AdamW(stages[rank].parameters(), lr=1e-3)
    trained = []
    for _ in range(4):
        optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(ids)
        elif rank == ranks - 1:
            schedule.step(target=labels, losses=losses)
            trained.append(round(sum(loss.item() for loss in losses) / microbatches, 4))
        else:
            schedule.step()
        optimizer.step()
    if rank == ranks - 1:
        print(f"losses: {trained}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
