"""The budget in the loops people run: an fx-traced decoder and a Hugging Face Qwen2, each planned for a loop and
measured in that loop.

    python bench/loops.py                        # writes bench/results/loops.md
    python bench/loops.py --width 128 --out -    # a quick look

Every loop trains with AdamW (its state counted: ``optimizer=`` the loop's own optimizer object) and drops the
model's output before backward (``keep_output=False``, as Trainer, TRL and Lightning do). The rows:

- fp32: one micro-step per optimizer step, gradients set to None before the forward (a plain loop);
- bf16: the step under ``torch.autocast(dtype=torch.bfloat16)`` (``autocast="bf16"``), at ``--budget`` and at 3%
  above the smallest peak any plan reaches (the model's floor);
- accumulation: 4 micro-steps per optimizer step (``gradient_accumulation_steps=4``): from the second on, the
  earlier ones' gradients are alive;
- Lightning: ``pytorch_lightning.Trainer`` with ``planner.stacks.lightning.PlanCallback``, which reads the
  optimizer and Lightning's order (gradients zeroed right before backward: the last step's alive in the forward).

Measured: the exact live-storage peak (``planner.profiling.measure.measure_loop_peak``: parameters, gradients,
AdamW's state and step, the batch and everything the loop allocates) over 2 optimizer steps; for
Lightning, from each batch's start to its end inside the Trainer. "unsaid" is the same model planned at the same
budget without saying the loop (fp32, one micro-step, no optimizer), measured in that loop.
"""

from __future__ import annotations

import argparse
import copy
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from planner import InfeasibleBudget, optimize  # noqa: E402
from planner.capture.inputs import as_inputs  # noqa: E402
from planner.common.loop import TrainingLoop, ZeroGrad  # noqa: E402
from planner.common.units import format_bytes  # noqa: E402
from planner.profiling.measure import measure_loop_peak  # noqa: E402
from planner.profiling.memtrack import LiveStorages  # noqa: E402


@dataclass(frozen=True)
class Model:
    name: str
    build: Callable[[], torch.nn.Module]
    inputs: Callable[[int], Any]  # seed -> a batch (a tuple or a dict of keyword arguments)
    loss_fn: Callable[[Any], torch.Tensor] | None


def fx_decoder(width: int, layers: int, rows: int, length: int) -> Model:
    sys.path.insert(0, str(ROOT / "examples"))
    from gpt import GPT, Config

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:  # a language model's loss shape: float32 log-softmax
        return torch.logsumexp(logits.float(), dim=-1).mean()

    config = Config(vocab=2048, context=length, width=width, heads=max(1, width // 64), layers=layers, dropout=0.0)

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return GPT(config)

    return Model("fx decoder (examples/gpt.py)", build,
                 lambda seed: (torch.randint(0, 2048, (rows, length), generator=torch.Generator().manual_seed(seed)),),
                 loss_fn)


def qwen2(width: int, layers: int, rows: int, length: int) -> Model:
    import transformers

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        config = transformers.Qwen2Config(vocab_size=2048, hidden_size=width, intermediate_size=int(2.75 * width),
                                          num_hidden_layers=layers, num_attention_heads=max(1, width // 64),
                                          num_key_value_heads=max(1, width // 128), use_cache=False)
        return transformers.Qwen2ForCausalLM(config)

    def inputs(seed: int) -> dict:
        ids = torch.randint(0, 2048, (rows, length), generator=torch.Generator().manual_seed(seed))
        return {"input_ids": ids, "labels": ids}

    return Model("Hugging Face Qwen2", build, inputs, None)


def measured_row(model: Model, label: str, budget: Any, loop: TrainingLoop, options: dict) -> dict:
    """Plans ``model`` for ``loop`` at ``budget`` and measures 2 optimizer steps of that loop; and the plan made
    without saying the loop, measured in it."""
    base = model.build()
    batches = [as_inputs(base, model.inputs(0))] * (2 * loop.gradient_accumulation_steps)  # one held, as a loader
    optimizer = torch.optim.AdamW(base.parameters())
    if budget == "floor":
        try:
            optimize(copy.deepcopy(base), 1, inputs=model.inputs(0), loss_fn=model.loss_fn, optimizer=optimizer,
                     **options)
        except InfeasibleBudget as exc:
            assert exc.min_peak_bytes is not None
            budget = int(1.03 * exc.min_peak_bytes)
    plan = optimize(base, budget, inputs=model.inputs(0), loss_fn=model.loss_fn, optimizer=optimizer, **options)
    measured = measure_loop_peak(plan.module, batches, model.loss_fn, loop=loop, optimizer=optimizer)
    unaware = optimize(model.build(), plan.budget_bytes, inputs=model.inputs(0), loss_fn=model.loss_fn,
                       keep_output=False)
    blind = measure_loop_peak(unaware.module, batches, model.loss_fn, loop=loop,
                              optimizer=torch.optim.AdamW(unaware.module.parameters()))
    return row(model, label, plan, measured, blind)


def lightning_row(model: Model, budget: Any) -> dict:
    """Lightning's own loop with the callback: each batch's peak inside the Trainer, the largest of 4 steps."""
    import pytorch_lightning as pl

    from planner.stacks.lightning import PlanCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model.build()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            out = self.model(**batch) if isinstance(batch, dict) else self.model(*batch)
            return model.loss_fn(out) if model.loss_fn else out.loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters())

    class Peaks(pl.Callback):
        def __init__(self) -> None:
            self.peaks: list[int] = []
            self.tracker: LiveStorages | None = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.tracker = LiveStorages("cpu")
            state = [t for o in trainer.optimizers for v in o.state.values() for t in v.values()
                     if isinstance(t, torch.Tensor)]
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
            values = batch.values() if isinstance(batch, dict) else batch
            for t in [*pl_module.parameters(), *pl_module.buffers(), *values, *grads, *state]:
                self.tracker.track(t)
            self.tracker.__enter__()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            assert self.tracker is not None
            self.tracker.__exit__(None, None, None)
            self.peaks.append(self.tracker.peak_bytes)

    batches = [model.inputs(seed) for seed in range(4)]
    planning = PlanCallback(budget, loss_fn=model.loss_fn, inputs=lambda b: b if isinstance(b, dict) else tuple(b))
    peaks = Peaks()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[planning, peaks])
    trainer.fit(Module(), torch.utils.data.DataLoader(batches, batch_size=None))
    return row(model, "Lightning (PlanCallback)", planning.plan, max(peaks.peaks), None)


def row(model: Model, label: str, plan: Any, measured: int, blind: int | None) -> dict:
    return {"model": model.name, "loop": label, "budget": plan.budget_bytes, "predicted": plan.predicted_peak_bytes,
            "measured": measured, "error": plan.predicted_peak_bytes / measured - 1, "blind": blind,
            "segments": len(plan.segments), "kept": plan.largest_kept, "counted": "; ".join(plan.counted[:-1])}


def table(rows: list[dict]) -> str:
    lines = ["| model | loop | budget | predicted | measured | predicted vs measured | fits | segments | "
             "unsaid: measured | counted |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        blind = "" if r["blind"] is None else (f"{format_bytes(r['blind'])} "
                                               f"({r['blind'] / r['budget'] - 1:+.1%} of budget)")
        lines.append(f"| {r['model']} | {r['loop']} | {format_bytes(r['budget'])} | {format_bytes(r['predicted'])} | "
                     f"{format_bytes(r['measured'])} | {r['error']:+.2%} | "
                     f"{'yes' if r['measured'] <= r['budget'] else 'NO'} | {r['segments']} | {blind} | "
                     f"{r['counted']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--budget", default="80%")
    parser.add_argument("--models", default="fx,qwen2", help="which of fx (the decoder), qwen2 to run")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "loops.md"), help="'-' prints")
    args = parser.parse_args()
    sizes = (args.width, args.layers, args.rows, args.length)
    makers = {"fx": fx_decoder, "qwen2": qwen2}
    rows = []
    for model in (makers[name](*sizes) for name in args.models.split(",")):
        dropped = {"keep_output": False}
        rows.append(measured_row(model, "fp32", args.budget, TrainingLoop(keep_output=False), dropped))
        bf16 = TrainingLoop(keep_output=False, autocast="bfloat16")
        rows.append(measured_row(model, "bf16 autocast", args.budget, bf16, {**dropped, "autocast": "bf16"}))
        rows.append(measured_row(model, "bf16 autocast, near the floor", "floor", bf16,
                                 {**dropped, "autocast": "bf16"}))
        rows.append(measured_row(model, "4 micro-steps", args.budget,
                                 TrainingLoop(keep_output=False, gradient_accumulation_steps=4),
                                 {**dropped, "gradient_accumulation_steps": 4}))
        rows.append(measured_row(model, "zero_grad before backward", args.budget,
                                 TrainingLoop(keep_output=False, zero_grad=ZeroGrad.BEFORE_BACKWARD),
                                 {**dropped, "zero_grad": "before_backward"}))
        rows.append(lightning_row(model, args.budget))
        print(table(rows), flush=True)
    text = (f"# The budget in the loops people run\n\n`python bench/loops.py --width {args.width} --layers "
            f"{args.layers} --rows {args.rows} --length {args.length} --budget {args.budget} --models "
            f"{args.models}` on "
            f"{platform.processor() or platform.machine()}, torch {torch.__version__}. Sizes: width {args.width}, "
            f"{args.layers} layers, {args.rows} x {args.length} tokens.\n\n{table(rows)}\n")
    if args.out == "-":
        print(text)
    else:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
