"""A training loop with Hugging Face accelerate on a planned model: one process, or a DDP job.

    python examples/accelerate_train.py                          # one process
    torchrun --nproc_per_node 2 examples/accelerate_train.py     # 2 CPU ranks on gloo

A tiny Qwen2 with random weights and in-memory batches: nothing is downloaded. ``plan_with`` plans the model
before ``accelerator.prepare`` for the step the ``Accelerator`` runs (its ``gradient_accumulation_steps`` and
``mixed_precision``) with the loop's optimizer counted; ``prepare`` wraps the planned module as it wraps any model
(``DistributedDataParallel`` in a job of several processes; ``torchrun`` sets the environment ``Accelerator``
reads). On several processes every rank runs the plan rank 0 made for one rank of the DDP job (its gradient
buckets counted too).
"""

import torch
import transformers
from accelerate import Accelerator

from planner.stacks.accelerate import plan_with

VOCAB, ROWS, LENGTH = 512, 4, 64
BUDGET = "60%"  # of one process's step without checkpointing (a DDP rank's: its buckets and AdamW's state too)


def build() -> transformers.Qwen2ForCausalLM:
    torch.manual_seed(0)  # the same weights on every rank
    config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=176, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    return transformers.Qwen2ForCausalLM(config)


def main() -> None:
    accelerator = Accelerator(cpu=True)  # joins the process group when launched on several processes
    steps = 4  # batches per process: accelerate gives each process its own share of the loader
    ids = torch.randint(0, VOCAB, (steps * ROWS * accelerator.num_processes, LENGTH),
                        generator=torch.Generator().manual_seed(1))
    rows = [{"input_ids": row, "labels": row} for row in ids]
    example = {"input_ids": ids[:ROWS], "labels": ids[:ROWS]}
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plan = plan_with(accelerator, model, BUDGET, inputs=example, optimizer=optimizer,
                     keep_output=False)  # train() keeps only the loss through backward
    accelerator.print(plan.summary())
    losses = train(accelerator, plan.module, optimizer, rows)
    print(f"rank {accelerator.process_index} losses: {losses}", flush=True)  # one write: the ranks share stdout
    accelerator.free_memory()  # drops the DDP wrapper before its process group: one outliving gloo's can hang at exit
    accelerator.end_training()


def train(accelerator: Accelerator, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
          rows: list[dict]) -> list[float]:
    loader = torch.utils.data.DataLoader(rows, batch_size=ROWS, shuffle=True)
    module, optimizer, loader = accelerator.prepare(module, optimizer, loader)
    losses = []
    for batch in loader:
        loss = module(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(round(loss.item(), 4))
    return losses


if __name__ == "__main__":
    main()
