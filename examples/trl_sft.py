"""Supervised fine-tuning with TRL's ``SFTTrainer``, its defaults included, planned by ckplan's Trainer callback.

    python examples/trl_sft.py

A tiny Qwen2 with random weights, a word-level tokenizer built in memory and an in-memory text dataset: nothing
is downloaded. ``PlanCallback`` plans the model object itself when training begins (as
``gradient_checkpointing_enable()`` would), from the first batch of the trainer's loader and what the trainer runs:
its AdamW, its precision, its accumulation, no output kept through backward. The plan follows the batch: TRL pads
each batch to its longest row, and each new length group is planned when a step first meets it, under the same
budget in bytes. TRL's ``SFTConfig`` turns Hugging Face's gradient checkpointing on by default; on the planned
model that call warns once and leaves it off, so that no layer is checkpointed twice. ``disable(model)`` takes the
plan off again.
"""

import tokenizers
import torch
import transformers
from datasets import Dataset
from trl import SFTConfig, SFTTrainer

from planner import disable
from planner.stacks.trainer import PlanCallback

WORDS, ROWS, LENGTH = 120, 4, 64


def tokenizer() -> transformers.PreTrainedTokenizerFast:
    """Words ``w0`` ... ``w119``, unknown, padding and end of sequence."""
    vocab = {f"w{i}": i for i in range(WORDS)} | {"[UNK]": WORDS, "[PAD]": WORDS + 1, "[EOS]": WORDS + 2}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", eos_token="[EOS]",
                                                unk_token="[UNK]")


def texts(count: int = 16) -> list[str]:
    """Random sentences of 24 to 63 words (up to 64 tokens with the end of sequence)."""
    g = torch.Generator().manual_seed(0)
    return [" ".join(f"w{int(i)}" for i in torch.randint(0, WORDS, (int(length),), generator=g))
            for length in torch.randint(24, LENGTH, (count,), generator=g)]


def build() -> transformers.Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=WORDS + 3, hidden_size=64, intermediate_size=176,
                                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                      pad_token_id=WORDS + 1, eos_token_id=WORDS + 2)
    return transformers.Qwen2ForCausalLM(config)


def main() -> None:
    model = build()
    planning = PlanCallback("60%")  # of the first batch's step without checkpointing, AdamW's state included
    args = SFTConfig(output_dir="/tmp/ckplan-trl-sft", max_steps=4, per_device_train_batch_size=ROWS,
                     logging_steps=1, use_cpu=True, save_strategy="no", report_to=[], seed=0, disable_tqdm=True)
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"text": texts()}),
                         processing_class=tokenizer(), callbacks=[planning])
    trainer.train()
    print(planning.plan.summary())
    print("losses:", [round(h["loss"], 4) for h in trainer.state.log_history if "loss" in h])
    disable(model)  # the model as it was: its own forward, Hugging Face's checkpointing methods back


if __name__ == "__main__":
    main()
