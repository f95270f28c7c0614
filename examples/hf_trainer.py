"""Fine-tune a Hugging Face causal LM with ``transformers.Trainer``, planned by ckplan's callback.

    python examples/hf_trainer.py

A tiny Qwen2 with random weights and an in-memory dataset: nothing is downloaded. ``PlanCallback`` plans the model
in place when training begins, from the first batch of the Trainer's loader and what the Trainer runs: its AdamW
(state counted), ``gradient_accumulation_steps`` (the earlier micro-steps' gradients counted), ``bf16``/``fp16``
(the step planned under that autocast), the model's own loss and no output kept through backward. With
``gradient_checkpointing=True`` in the arguments, Trainer's call to ``gradient_checkpointing_enable()`` would warn
once and leave Hugging Face's checkpointing off: the plan decides what is recomputed.
"""

import torch
import transformers
from datasets import Dataset

from planner.stacks.trainer import PlanCallback

VOCAB, ROWS, LENGTH = 512, 4, 64


def build() -> transformers.Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=176, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2)
    return transformers.Qwen2ForCausalLM(config)


def main() -> None:
    ids = torch.randint(0, VOCAB, (8 * ROWS, LENGTH), generator=torch.Generator().manual_seed(1))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    args = transformers.TrainingArguments(output_dir="/tmp/ckplan-hf-trainer", max_steps=4, learning_rate=1e-3,
                                          per_device_train_batch_size=ROWS, gradient_accumulation_steps=2,
                                          logging_steps=1, use_cpu=True, save_strategy="no", report_to=[], seed=0,
                                          disable_tqdm=True)
    planning = PlanCallback("60%")  # of the step Trainer runs without checkpointing, AdamW's state included
    trainer = transformers.Trainer(model=build(), args=args, train_dataset=data, callbacks=[planning])
    trainer.train()
    print(planning.plan.summary())
    print("losses:", [round(h["loss"], 4) for h in trainer.state.log_history if "loss" in h])


if __name__ == "__main__":
    main()
