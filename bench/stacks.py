"""TRL's SFTTrainer and transformers' Trainer with their defaults on a planned model: step time and losses.

    python bench/stacks.py                       # writes bench/results/stacks.md
    python bench/stacks.py --steps 6 --width 256 --out /tmp/stacks.md

A Llama-style decoder (random weights, an in-memory word-level tokenizer and texts of random lengths, so that
TRL pads each batch to its own longest row) is planned in place with ``planner.enable`` at ``--budget`` of its
un-checkpointed peak on the longest batch. Each row trains ``--steps`` steps from the same weights and seeds:

- SFTTrainer, TRL's defaults (``gradient_checkpointing=True``) on the unplanned model: Hugging Face's own;
- SFTTrainer on the planned model with ``gradient_checkpointing=False``: the plan alone;
- SFTTrainer, TRL's defaults, on the planned model: ckplan leaves Hugging Face's checkpointing off;
- the same two for transformers' Trainer on ``plan.module`` (``TrainingArguments(gradient_checkpointing=...)``).

Step time: median over the steps after the first (each step timed by a callback, ``on_step_begin`` to
``on_step_end``); the rows of a pair run alternately, ``--rounds`` times, and the shape groups the batches
need are planned in a warm-up run first. Losses are compared with the unplanned run of the same settings.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def tokenizer(vocab: int):
    import tokenizers

    words = {f"w{i}": i for i in range(vocab - 3)} | {"[UNK]": vocab - 3, "[PAD]": vocab - 2, "[EOS]": vocab - 1}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=words, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", eos_token="[EOS]",
                                                unk_token="[UNK]")


def texts(n: int, vocab: int, longest: int) -> list[str]:
    g = torch.Generator().manual_seed(0)
    return [" ".join(f"w{int(i)}" for i in torch.randint(0, vocab - 3, (int(length),), generator=g))
            for length in torch.randint(longest // 4, longest, (n,), generator=g)]


def build(width: int, layers: int, vocab: int):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=width * 8 // 3,
                                      num_hidden_layers=layers, num_attention_heads=width // 64,
                                      num_key_value_heads=max(1, width // 128), pad_token_id=vocab - 2,
                                      eos_token_id=vocab - 1)
    return transformers.LlamaForCausalLM(config)


class StepTimer(transformers.TrainerCallback):
    """Times each optimizer step, ms."""

    def __init__(self) -> None:
        self.ms: list[float] = []
        self._start = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.ms.append((time.perf_counter() - self._start) * 1e3)


def sft(module, data, tok, steps: int, flag: bool) -> tuple[list[float], list[float]]:
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(output_dir="/tmp/ckplan-bench-sft", max_steps=steps, per_device_train_batch_size=4,
                     report_to=[], logging_steps=1, use_cpu=True, save_strategy="no", seed=0,
                     gradient_checkpointing=flag, disable_tqdm=True)
    timer = StepTimer()
    trainer = SFTTrainer(model=module, args=args, train_dataset=data, processing_class=tok, callbacks=[timer])
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], timer.ms[1:]


def trainer_run(module, rows, steps: int, flag: bool) -> tuple[list[float], list[float]]:
    args = transformers.TrainingArguments(output_dir="/tmp/ckplan-bench-trainer", max_steps=steps, report_to=[],
                                          per_device_train_batch_size=4, logging_steps=1, use_cpu=True,
                                          save_strategy="no", seed=0, gradient_checkpointing=flag,
                                          disable_tqdm=True)
    timer = StepTimer()
    trainer = transformers.Trainer(model=module, args=args, train_dataset=rows, callbacks=[timer])
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], timer.ms[1:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4000)
    p.add_argument("--longest", type=int, default=256)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--budget", default="60%")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "stacks.md"))
    args = p.parse_args()

    from datasets import Dataset

    from planner import enable, optimize

    tok = tokenizer(args.vocab)
    data = Dataset.from_dict({"text": texts(4 * args.steps, args.vocab, args.longest)})
    longest = tok([texts(1, args.vocab, args.longest)[0]] * 4, return_tensors="pt", padding="max_length",
                  max_length=args.longest, truncation=True)
    example = {"input_ids": longest["input_ids"], "attention_mask": longest["attention_mask"],
               "labels": longest["input_ids"]}  # as TRL's collator makes a batch
    g = torch.Generator().manual_seed(1)
    rows = Dataset.from_dict({"input_ids": torch.randint(0, args.vocab - 3, (4 * args.steps, args.longest),
                                                         generator=g).tolist()})
    rows = rows.map(lambda r: {"labels": r["input_ids"]})
    model = build(args.width, args.layers, args.vocab)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    plan = enable(model, args.budget, inputs=example, keep_output=False)
    sft(model, data, tok, args.steps, False)  # plans the shape groups TRL's batches need
    samples: dict[str, list[float]] = {}
    losses: dict[str, list[float]] = {}

    def record(name: str, result: tuple[list[float], list[float]]) -> None:
        losses[name] = result[0]
        samples.setdefault(name, []).extend(result[1])

    reference = build(args.width, args.layers, args.vocab)
    record("SFTTrainer, unplanned, TRL's defaults (HF checkpointing)", sft(reference, data, tok, args.steps, True))
    for _ in range(args.rounds):
        for flag, name in ((False, "SFTTrainer, plan alone"), (True, "SFTTrainer, plan + TRL's defaults")):
            model.load_state_dict(initial)
            record(name, sft(model, data, tok, args.steps, flag))
    from planner import disable

    disable(model)
    model.load_state_dict(initial)
    planned = optimize(model, args.budget, inputs=example, keep_output=False, follow_batch=False)
    reference = build(args.width, args.layers, args.vocab)
    record("Trainer, unplanned, gradient_checkpointing=True", trainer_run(reference, rows, args.steps, True))
    for _ in range(args.rounds):
        for flag, name in ((False, "Trainer, plan alone"), (True, "Trainer, plan + gradient_checkpointing=True")):
            model.load_state_dict(initial)
            record(name, trainer_run(planned.module, rows, args.steps, flag))
    lines = [
        "# Fine-tuning stacks with their defaults on a planned model", "",
        f"`python bench/stacks.py --width {args.width} --layers {args.layers} --vocab {args.vocab} --longest "
        f"{args.longest} --steps {args.steps} --rounds {args.rounds} --budget {args.budget}` on {platform.machine()}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}, transformers {transformers.__version__}, CPU. "
        f"Llama-style decoder, width {args.width}, {args.layers} layers ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
        f"parameters), batches of 4; plan at {args.budget} of the un-checkpointed peak on a {args.longest}-token batch "
        f"({plan.segments.__len__()} segments there). SFTTrainer's batches are padded to their longest row "
        f"({args.longest // 4}-{args.longest} tokens), so the plan follows the batch; Trainer's are all "
        f"{args.longest} tokens, one plan.", "",
        "| run | median step | vs the plan alone | losses |",
        "|---|---|---|---|",
    ]
    for stack in ("SFTTrainer", "Trainer"):
        alone = statistics.median(samples[f"{stack}, plan alone"])
        for name, times in samples.items():
            if name.startswith(stack + ","):
                same = "equal to the plan alone" if losses[name] == losses[f"{stack}, plan alone"] else \
                    f"max difference {max(abs(a - b) for a, b in zip(losses[name], losses[f'{stack}, plan alone'])):.2e}"
                lines.append(f"| {name} | {statistics.median(times):,.0f} ms | "
                             f"{statistics.median(times) / alone - 1:+.1%} | {same} |")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
