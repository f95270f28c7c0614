"""ckplan against Hugging Face's own gradient checkpointing, on Hugging Face decoders as they are
fine-tuned (random weights from configs, a right-padded collator batch, the loss from ``labels``).

For each model: the un-checkpointed step, ``gradient_checkpointing_enable(use_reentrant=False)``
(every decoder layer), and ckplan planned at the *measured* peak of HF's checkpointing. Peaks are
live bytes of one step measured the same way for all three; step times are medians of interleaved
steps (``measure.step_times_ms``). Both loops drop or keep the output as ``--keep-output`` says.

    python bench/hf_report.py > bench/results/hf.md
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers

from planner import optimize
from planner.capture.inputs import as_inputs
from planner.common.budget import format_bytes
from planner.profiling.measure import measure_peak, step_times_ms

VOCAB = 8000


def qwen2(width: int, layers: int) -> transformers.PreTrainedModel:
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=width, intermediate_size=width * 11 // 4, num_hidden_layers=layers,
        num_attention_heads=width // 64, num_key_value_heads=max(1, width // 256), max_position_embeddings=2048,
        tie_word_embeddings=True))


def llama(width: int, layers: int) -> transformers.PreTrainedModel:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=width, intermediate_size=width * 8 // 3, num_hidden_layers=layers,
        num_attention_heads=width // 64, num_key_value_heads=width // 64, max_position_embeddings=2048))


def gpt2(width: int, layers: int) -> transformers.PreTrainedModel:
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=width, n_layer=layers, n_head=width // 64, n_positions=2048))


FAMILIES = {"qwen2": qwen2, "llama": llama, "gpt2": gpt2}


def batch(rows: int, length: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(length // 2, length + 1, (rows,), generator=generator)
    lengths[0] = length
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    ids = torch.randint(1, VOCAB, (rows, length), generator=generator) * mask
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def loss_of(output):
    return output.loss


def row(family: str, width: int, layers: int, rows: int, length: int, keep: bool, runs: int) -> str:
    torch.manual_seed(0)
    model = FAMILIES[family](width, layers).train()
    hf = FAMILIES[family](width, layers).train()
    hf.load_state_dict(model.state_dict())
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    example = batch(rows, length)
    inputs = as_inputs(model, example)
    hf_peak = measure_peak(hf, inputs, loss_of, keep_output=keep)
    start = time.perf_counter()
    plan = optimize(model, hf_peak, inputs=example, keep_output=keep, time_limit_s=60)
    plan_s = time.perf_counter() - start
    ours_peak = measure_peak(plan.module, inputs, loss_of, keep_output=keep)
    model.config.use_cache = False  # the un-checkpointed baseline without a cache, as in training
    base_peak = measure_peak(model, inputs, loss_of, keep_output=keep)
    times = [step_times_ms([model, hf, plan.module], inputs, loss_of, runs=runs) for _ in range(3)]
    base, hf_ms, ours_ms = (statistics.median(t[i] for t in times) for i in range(3))
    spread = max(t[2] / t[0] for t in times) - min(t[2] / t[0] for t in times)
    saves = sum(len(s.saved_nodes) for s in plan.segments)
    return (f"| {family} w{width} L{layers} b{rows}×{length} | {format_bytes(base_peak)} | {format_bytes(hf_peak)} | "
            f"{format_bytes(ours_peak)} ({format_bytes(plan.predicted_peak_bytes)} predicted) | "
            f"{100 * (hf_ms / base - 1):+.1f}% | {100 * (ours_ms / base - 1):+.1f}% (±{50 * spread:.1f}) | "
            f"{len(plan.segments)} chains, {saves} saves | {plan_s:.0f} s |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--families", default="qwen2,llama,gpt2")
    parser.add_argument("--keep-output", action=argparse.BooleanOptionalAction, default=False,
                        help="the loop keeps the output through backward (default: dropped, as Trainer does)")
    args = parser.parse_args()
    print(f"# ckplan vs Hugging Face gradient checkpointing (keep_output={args.keep_output})\n")
    print("Command: `python bench/hf_report.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "keep_output")
        + (" --keep-output" if args.keep_output else "") + "`; torch " + torch.__version__ + ", transformers "
        + transformers.__version__ + ", CPU.\n")
    print("Overhead = median step time over the un-checkpointed step's, minus 1 (3 rounds of interleaved steps; "
          "± is half the spread of ckplan's ratio across rounds). ckplan is planned at the measured peak of HF's "
          "checkpointing.\n")
    print("| model | no checkpointing | HF checkpointing | ckplan at HF's peak | HF overhead | ckplan overhead "
          "| plan | planning time |")
    print("|---|---|---|---|---|---|---|---|")
    for family in args.families.split(","):
        print(row(family, args.width, args.layers, args.rows, args.length, args.keep_output, args.runs), flush=True)


if __name__ == "__main__":
    main()
