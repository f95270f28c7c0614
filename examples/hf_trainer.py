"""Fine-tune a Hugging Face causal LM with ``transformers.Trainer`` on the module ckplan planned.

    python examples/hf_trainer.py

A tiny Qwen2 with random weights and an in-memory dataset: nothing is downloaded. ``plan.module`` is a
``Qwen2ForCausalLM`` sharing the model's parameters, so Trainer, ``generate()`` and ``save_pretrained()`` take it
as they take the model. Trainer's loop keeps only the loss through backward, hence ``keep_output=False``. With
``gradient_checkpointing=True`` in the arguments, Trainer's call to ``gradient_checkpointing_enable()`` would warn
once and leave Hugging Face's checkpointing off: the plan decides what is recomputed.
"""

import torch
import transformers
from datasets import Dataset

from planner import optimize

VOCAB, ROWS, LENGTH = 512, 4, 64


def build() -> transformers.Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=176, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2)
    return transformers.Qwen2ForCausalLM(config)


def main() -> None:
    ids = torch.randint(0, VOCAB, (4 * ROWS, LENGTH), generator=torch.Generator().manual_seed(1))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    model = build()
    plan = optimize(model, "60%", inputs={"input_ids": ids[:ROWS], "labels": ids[:ROWS]}, keep_output=False)
    print(plan.summary())
    args = transformers.TrainingArguments(output_dir="/tmp/ckplan-hf-trainer", max_steps=4, learning_rate=1e-3,
                                          per_device_train_batch_size=ROWS, logging_steps=1, use_cpu=True,
                                          save_strategy="no", report_to=[], seed=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=plan.module, args=args, train_dataset=data)
    trainer.train()
    print("losses:", [round(h["loss"], 4) for h in trainer.state.log_history if "loss" in h])


if __name__ == "__main__":
    main()
