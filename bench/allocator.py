"""Held-out models, planned at their own checkpointing's peak and measured where memory runs out: the allocator.

Each model's own hand placement (timm's ``set_grad_checkpointing()``, diffusers' ``enable_gradient_checkpointing()``)
is measured at the allocator (``planner.profiling.measure.measure_peak``: torch.profiler's memory events on a CPU,
every allocation and free, workspaces that ops allocate inside themselves included), ckplan plans the plain model at
exactly that peak, and the plan is measured the same way. torchvision's models are planned at half the activations
of their plain step (the budget halfway between the parameters' and the plain step's peak). A plain loop: the output
is kept through backward.

timm and torchvision do not import beside the torch 2.13 CPU wheel this project installs, so this runs in a venv
of its own (the machine notes: torch 2.14.1 + torchvision 0.29.1, a CUDA build that runs on CPU)::

    python3 -m venv /work/tv-venv && . /work/tv-venv/bin/activate
    pip install torch==2.14.1 torchvision==0.29.1 timm && pip install -e ".[test]"
    OMP_NUM_THREADS=1 python bench/allocator.py        # bench/results/allocator.md
"""

from __future__ import annotations

import argparse
import copy
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MiB = 2**20


def timm_case(name: str, batch: int, size: int) -> tuple:
    import timm

    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=100)
    hand = copy.deepcopy(model)
    hand.set_grad_checkpointing(True)
    x, y = torch.randn(batch, 3, size, size), torch.randint(0, 100, (batch,))
    return model, hand, (x,), lambda out: torch.nn.functional.cross_entropy(out, y)


def torchvision_case(name: str, batch: int, size: int) -> tuple:
    import torchvision

    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(num_classes=100)
    x, y = torch.randn(batch, 3, size, size), torch.randint(0, 100, (batch,))
    return model, None, (x,), lambda out: torch.nn.functional.cross_entropy(out, y)


def unet_case(batch: int) -> tuple:
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    model = UNet2DConditionModel(sample_size=32, in_channels=4, out_channels=4, layers_per_block=1,
                                 block_out_channels=(64, 128), cross_attention_dim=64, attention_head_dim=8,
                                 down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                 up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))
    hand = copy.deepcopy(model)
    hand.enable_gradient_checkpointing()
    noise = torch.randn(batch, 4, 32, 32)
    inputs = {"sample": torch.randn(batch, 4, 32, 32), "timestep": torch.randint(0, 1000, (batch,)),
              "encoder_hidden_states": torch.randn(batch, 16, 64)}
    return model, hand, inputs, lambda out: torch.nn.functional.mse_loss(out.sample, noise)


def row(name: str, case: tuple, time_limit_s: float) -> dict:
    from planner import InfeasibleBudget, optimize
    from planner.capture.inputs import as_inputs
    from planner.profiling.measure import measure_live_peak, measure_peak

    model, hand, inputs, loss_fn = case
    example = as_inputs(model, inputs)
    plain = measure_peak(model, example, loss_fn)
    if hand is not None:
        budget = measure_peak(hand, as_inputs(hand, inputs), loss_fn)
        against = "its own checkpointing's peak"
    else:
        params = sum(t.untyped_storage().nbytes() for t in [*model.parameters(), *model.buffers()])
        budget = (params + plain) // 2
        against = "half its activations"
    began = time.perf_counter()
    try:
        plan = optimize(model, budget, inputs=inputs, loss_fn=loss_fn, time_limit_s=time_limit_s)
    except InfeasibleBudget as exc:  # below what any plan reaches: planned at the smallest peak instead
        assert exc.min_peak_bytes is not None
        budget, against = exc.min_peak_bytes, f"{against} ({budget / MiB:.1f} MiB): infeasible, its smallest peak"
        plan = optimize(model, budget, inputs=inputs, loss_fn=loss_fn, time_limit_s=time_limit_s)
    planned = time.perf_counter() - began
    measured = measure_peak(plan.module, example, loss_fn)
    return {"model": name, "against": against, "plain": plain, "plain_live": measure_live_peak(model, example, loss_fn),
            "budget": budget, "predicted": plan.predicted_peak_bytes, "measured": measured,
            "segments": len(plan.segments), "planned_s": planned}


CASES: dict[str, Callable[[argparse.Namespace], tuple]] = {
    "timm-convnext_tiny": lambda a: timm_case("convnext_tiny", a.batch, a.size),
    "timm-resnet50": lambda a: timm_case("resnet50", a.batch, a.size),
    "timm-vit_small": lambda a: timm_case("vit_small_patch16_224", a.batch, 224),
    "tv-convnext_tiny": lambda a: torchvision_case("convnext_tiny", a.batch, a.size),
    "tv-resnet50": lambda a: torchvision_case("resnet50", a.batch, a.size),
    "tv-efficientnet_b0": lambda a: torchvision_case("efficientnet_b0", a.batch, a.size),
    "tv-mobilenet_v3_large": lambda a: torchvision_case("mobilenet_v3_large", a.batch, a.size),
    "diffusers-unet": lambda a: unet_case(a.batch),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--time-limit", type=float, default=30.0)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "allocator.md"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name in args.models:
        rows.append(row(name, CASES[name](args), args.time_limit))
        r = rows[-1]
        print(f"{name}: budget {r['budget'] / MiB:.1f} MiB, predicted {r['predicted'] / MiB:.1f}, "
              f"measured {r['measured'] / MiB:.1f} ({100 * (r['measured'] / r['budget'] - 1):+.2f}% of the budget)",
              flush=True)
    lines = [
        "# Held-out models at the allocator", "",
        f"`OMP_NUM_THREADS=1 python bench/allocator.py --batch {args.batch} --size {args.size}` "
        f"(torch {torch.__version__}, {platform.processor() or platform.machine()}, one thread). Every peak is "
        "measured at the CPU allocator (`measure_peak`: torch.profiler's memory events, workspaces ops allocate "
        "inside themselves included), one training step of a plain loop (the output kept through backward); "
        "\"dispatcher\" is the same plain step counted as live tensor storages (`measure_live_peak`), which "
        "misses what ops allocate inside themselves. The budget is the model's own checkpointing's measured peak "
        "(timm's `set_grad_checkpointing()`, diffusers' `enable_gradient_checkpointing()`) or, for torchvision, "
        "halfway between the parameters and the plain step.", "",
        "| model | budget at | plain step (dispatcher) | budget | ckplan predicted | ckplan measured | "
        "measured vs budget | measured vs predicted | segments | planned in |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['against']} | {r['plain'] / MiB:.1f} MiB ({r['plain_live'] / MiB:.1f}) | "
            f"{r['budget'] / MiB:.1f} MiB | {r['predicted'] / MiB:.2f} MiB | {r['measured'] / MiB:.2f} MiB | "
            f"{100 * (r['measured'] / r['budget'] - 1):+.2f}% | {100 * (r['measured'] / r['predicted'] - 1):+.3f}% | "
            f"{r['segments']} | {r['planned_s']:.0f} s |")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
