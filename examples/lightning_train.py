"""A LightningModule that plans its model in ``configure_model``, trained by ``pytorch_lightning.Trainer``.

    python examples/lightning_train.py

A tiny Qwen2 with random weights and in-memory batches: nothing is downloaded. ``configure_model`` runs once the
Trainer has placed the module, before the optimizer is made; plan there (``enable`` plans the model object in
place; ``self.model = optimize(...).module`` works the same). Lightning zeroes gradients after ``training_step``,
so the previous step's gradients stay alive through the next forward, on top of the step a budget bounds;
``optimizer_step`` below frees them after each optimizer step instead, as a plain loop does.
"""

import pytorch_lightning as pl
import torch
import transformers

from planner import enable

VOCAB, ROWS, LENGTH = 512, 4, 64


class Finetune(pl.LightningModule):
    def __init__(self, budget: str = "60%") -> None:
        super().__init__()
        torch.manual_seed(0)
        config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=176,
                                          num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
        self.model = transformers.Qwen2ForCausalLM(config)
        self.budget, self.plan = budget, None
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.plan is None:  # Lightning may call it more than once (fit, then validate or test)
            example = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=torch.Generator().manual_seed(1))
            self.plan = enable(self.model, self.budget, inputs={"input_ids": example, "labels": example},
                               keep_output=False)  # training_step returns only the loss
            print(self.plan.summary())

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.losses.append(round(loss.item(), 4))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
        optimizer.step(closure=optimizer_closure)
        optimizer.zero_grad(set_to_none=True)  # the next step starts without gradients


def main() -> None:
    ids = torch.randint(0, VOCAB, (4 * ROWS, LENGTH), generator=torch.Generator().manual_seed(2))
    loader = torch.utils.data.DataLoader([{"input_ids": row, "labels": row} for row in ids], batch_size=ROWS)
    module = Finetune()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, loader)
    print("losses:", module.losses)


if __name__ == "__main__":
    main()
