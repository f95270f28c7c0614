"""A LightningModule trained by ``pytorch_lightning.Trainer``, its model planned by ckplan's callback.

    python examples/lightning_train.py

A tiny Qwen2 with random weights and in-memory batches: nothing is downloaded. ``PlanCallback`` plans the
LightningModule's ``model`` in place when training starts, from the first batch of the training loader and what
the Trainer runs: the optimizer (state counted), ``precision``, ``accumulate_grad_batches``, and Lightning's
order, which zeroes gradients right before backward (the last step's gradients are alive through the forward, and
counted). The LightningModule is Lightning's usual one: nothing in it knows about ckplan.
"""

import pytorch_lightning as pl
import torch
import transformers

from planner.stacks.lightning import PlanCallback

VOCAB, ROWS, LENGTH = 512, 4, 64


class Finetune(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=176,
                                          num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
        self.model = transformers.Qwen2ForCausalLM(config)
        self.losses: list[float] = []

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.losses.append(round(loss.item(), 4))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    ids = torch.randint(0, VOCAB, (4 * ROWS, LENGTH), generator=torch.Generator().manual_seed(2))
    loader = torch.utils.data.DataLoader([{"input_ids": row, "labels": row} for row in ids], batch_size=ROWS)
    module = Finetune()
    planning = PlanCallback("60%")  # of the step Lightning runs without checkpointing, AdamW's state included
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[planning])
    trainer.fit(module, loader)
    print(planning.plan.summary())
    print("losses:", module.losses)


if __name__ == "__main__":
    main()
