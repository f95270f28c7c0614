"""Plans that follow the batch against one plan for every batch and Hugging Face gradient checkpointing,
over an epoch of dynamically padded batches of long-tailed lengths.

    python bench/shapes.py                       # writes bench/results/shapes.md
    python bench/shapes.py --batches 8 --out -   # a quick look

A Llama-style decoder (width 512, 6 layers, 8 heads / 4 key-value heads, vocab 8000, random weights).
Row lengths are log-normal with a median of a quarter of the longest (``--longest``, sigma 0.8, clipped to
[8, longest]); rows are shuffled into batches of 4, each padded to its longest row rounded up to a multiple
of 8 (``DataCollatorWithPadding(pad_to_multiple_of=8)``), with ``attention_mask`` and labels -100 on the
padding. One batch holds a row of the longest length.

The budget is the measured peak of Hugging Face gradient checkpointing (``activation_checkpointing_enable``,
non-reentrant, every layer) on the longest batch. ckplan plans that batch at that budget once (one plan for every
batch) and once following the batch. Every step is Trainer's: ``model(**batch).loss`` with the output
dropped before ``backward``, gradients set to None after it; no optimizer state. Per batch the four
models (unplanned, HF checkpointing, ckplan's single plan, ckplan following the batch) step in turn,
``--runs`` rounds after one round of warm-up; a batch's time is the median of its rounds. Recompute is a
model's epoch time minus the unplanned model's. Peaks are measured per batch (live tensor storages:
parameters, gradients, activations, the loss). The groups the following plan needs are planned in a pass
before the timed epoch; that pass is timed (the one-off planning cost).

Then the times the family scales from the longest batch (``planner.profiling.scaling.scaled_profile``) are checked
against a profile measured at a group's own shape: step time, and the recompute of the group's plan
against that of a plan made from the measured profile at the same budget.
"""

from __future__ import annotations

import argparse
import copy
import math
import platform
import statistics
import time
from pathlib import Path

import torch
import transformers

from planner import optimize
from planner.capture.inputs import as_inputs
from planner.common.budget import format_bytes
from planner.pipeline import profile
from planner.profiling.measure import measure_peak, step_samples_ms

ROOT = Path(__file__).resolve().parent.parent
VOCAB, ROWS, PAD_MULTIPLE = 8000, 4, 8


def build() -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=1376, num_hidden_layers=6,
                                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                                      use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.train()
    return model


def lengths(count: int, longest: int, seed: int) -> list[int]:
    """``count`` row lengths, log-normal with median ``longest / 4``, one of them ``longest``."""
    generator = torch.Generator().manual_seed(seed)
    drawn = torch.exp(math.log(longest / 4) + 0.8 * torch.randn(count, generator=generator))
    out = [int(min(longest, max(8, round(float(x))))) for x in drawn]
    out[int(torch.randint(count, (1,), generator=generator))] = longest
    return out


def collate(rows: list[int], seed: int) -> dict[str, torch.Tensor]:
    """Rows of these lengths right-padded to the longest (a multiple of 8), as a padding collator makes them."""
    generator = torch.Generator().manual_seed(seed)
    width = math.ceil(max(rows) / PAD_MULTIPLE) * PAD_MULTIPLE
    mask = (torch.arange(width)[None, :] < torch.tensor(rows)[:, None]).long()
    ids = torch.randint(1, VOCAB, (len(rows), width), generator=generator) * mask
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def hf_checkpointing(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` with Hugging Face's gradient checkpointing (every decoder layer, non-reentrant)."""
    copied = copy.deepcopy(model)
    if hasattr(copied, "activation_checkpointing_enable"):  # transformers >= 5.x; the older name warns there
        copied.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        copied.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    copied.train()
    return copied


def time_scaling_rows(model: torch.nn.Module, follow, budget: int, longest: int) -> list[str]:
    """Scaled times of a few groups against profiles measured at the groups' own shapes."""
    out = []
    for length in sorted({longest // 4, longest // 2, 3 * longest // 4}):
        batch = collate([length] * ROWS, seed=length)
        key = follow.family.grid.group({k: tuple(v.shape) for k, v in batch.items()})
        group = follow.family.plan_of(key, batch)
        upper = dict(key)["input_ids"]
        at_shape = collate([upper[1]] * upper[0], seed=length)
        measured = profile(model, inputs=at_shape, keep_output=False)
        direct = optimize(model, budget, inputs=at_shape, profile=measured, keep_output=False, follow_batch=True,
                          time_limit_s=30, selective=False)
        out.append(f"| {upper[0]} × {upper[1]} | {group.step_ms:.0f} ms | {measured.step_ms:.0f} ms | "
                   f"{100 * (group.step_ms / measured.step_ms - 1):+.1f}% | {group.recompute_ms:.1f} ms "
                   f"({len(group.segments)} segments) | {direct.recompute_ms:.1f} ms ({len(direct.segments)} segments) |")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=32)
    p.add_argument("--longest", type=int, default=512)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "shapes.md"))
    args = p.parse_args()

    model = build()
    rows = lengths(args.batches * ROWS, args.longest, seed=0)
    batches = [collate(rows[i:i + ROWS], seed=i) for i in range(0, len(rows), ROWS)]
    longest = max(batches, key=lambda b: b["input_ids"].shape[1])
    hf = hf_checkpointing(model)
    budget = measure_peak(hf, as_inputs(hf, longest), keep_output=False)
    unplanned_longest = measure_peak(model, as_inputs(model, longest), keep_output=False)

    started = time.perf_counter()
    single = optimize(model, budget, inputs=longest, keep_output=False, time_limit_s=30, selective=False)
    single_s = time.perf_counter() - started
    started = time.perf_counter()
    follow = optimize(model, budget, inputs=longest, keep_output=False, follow_batch=True, time_limit_s=30,
                      selective=False)
    follow_s = time.perf_counter() - started
    started = time.perf_counter()
    for batch in batches:  # plans every group the epoch needs (what the first epoch pays once)
        follow.module(**batch).loss.backward()
    for q in model.parameters():
        q.grad = None
    groups_s = time.perf_counter() - started

    names = ("unplanned", "HF gradient checkpointing", "ckplan, one plan", "ckplan, following the batch")
    modules = (model, hf, single.module, follow.module)
    times = [0.0] * 4
    peaks = [0] * 4
    fits = 0
    for batch in batches:
        given = as_inputs(model, batch)
        for i, module in enumerate(modules):
            peaks[i] = max(peaks[i], measure_peak(module, given, keep_output=False))
        fits += measure_peak(model, given, keep_output=False) <= budget
        samples = step_samples_ms(list(modules), given, runs=args.runs)
        times = [t + statistics.median(s) for t, s in zip(times, samples)]

    planned_groups = follow.family.table()
    widths = sorted(b["input_ids"].shape[1] for b in batches)
    recompute = [t - times[0] for t in times]
    lines = [
        "# Plans that follow the batch",
        "",
        f"`python bench/shapes.py --batches {args.batches} --longest {args.longest} --runs {args.runs}` on "
        f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, CPU.",
        "",
        f"Llama-style decoder, width 512, 6 layers, vocab {VOCAB} ({sum(q.numel() for q in model.parameters()) / 1e6:.1f}M "
        f"parameters). {len(batches)} batches of {ROWS} rows; row lengths log-normal, median {args.longest // 4} "
        f"(a quarter of the longest, {args.longest}), sigma 0.8; each batch padded to its longest row (a multiple "
        f"of 8): padded lengths median {statistics.median(widths):.0f}, from {widths[0]} to {widths[-1]}.",
        "",
        f"Budget: the measured peak of HF gradient checkpointing on the longest batch, {format_bytes(budget)} "
        f"(unplanned: {format_bytes(unplanned_longest)}). {fits} of {len(batches)} batches fit it without any "
        "checkpoint. Peaks: parameters, gradients, activations and the loss of one Trainer-style step (output "
        "dropped before backward), no optimizer state.",
        "",
        "| | epoch time | recompute (epoch time − unplanned) | recompute vs HF | largest peak of any step |",
        "|---|---|---|---|---|",
    ]
    for i, name in enumerate(names):
        versus = f"{100 * (recompute[i] / recompute[1] - 1):+.0f}%" if i and recompute[1] > 0 else ""
        over = " (over the budget)" if peaks[i] > budget else ""
        lines.append(f"| {name} | {times[i] / 1000:.1f} s | {recompute[i] / 1000:.1f} s | {versus} | "
                     f"{format_bytes(peaks[i])}{over} |")
    lines += [
        "",
        f"Planning: one plan {single_s:.1f} s; following the batch {follow_s:.1f} s for the longest batch's group, "
        f"then {groups_s:.1f} s for the pass that planned the other {len(planned_groups) - 1} groups the epoch "
        "needs (each capture, meta replay and solve, plus that pass's own steps).",
        "",
        "Shape groups planned (upper shapes; predicted from one profile of the longest batch):",
        "",
        "| group | segments | peak: un-checkpointed → predicted | predicted recompute |",
        "|---|---|---|---|",
    ]
    for row in planned_groups:
        shape = "×".join(map(str, row["shapes"]["input_ids"]))
        lines.append(f"| {shape} | {row['segments']} | {format_bytes(row['baseline_peak_bytes'])} → "
                     f"{format_bytes(row['predicted_peak_bytes'])} | +{100 * row['overhead']:.1f}% |")
    lines += [
        "",
        "## Times scaled from the longest batch vs a profile at the group's shape",
        "",
        "| group | scaled step | measured-profile step | error | recompute of the group's plan | "
        "recompute of a plan from the measured profile |",
        "|---|---|---|---|---|---|",
        *time_scaling_rows(model, follow, budget, args.longest),
    ]
    text = "\n".join(lines) + "\n"
    if args.out == "-":
        print(text)
    else:
        Path(args.out).write_text(text)
        print(text)


if __name__ == "__main__":
    main()
