"""ckplan against diffusers' own gradient checkpointing, on diffusion models as they are fine-tuned (random
weights from configs, nothing downloaded).

    OMP_NUM_THREADS=1 python bench/diffusers_report.py          # writes bench/results/diffusers.md
    python bench/diffusers_report.py --models sd3-lora --runs 3 --out -

Models (CPU-feasible cuts of the real shapes), full fine-tuning unless named ``-lora``:

- ``unet``: Stable Diffusion 1.5's UNet layout (3 cross-attention down blocks, a plain one, the mid block and
  back up, 2 resnets per block, text states 77 x 768) at a fifth of its width (64, 128, 256, 256 channels), on
  32 x 32 latents, batch 2; the noise-prediction loss.
- ``unet-lora``: the same UNet frozen, with rank-16 LoRA adapters on the attention projections (``add_adapter``,
  the targets of diffusers' LoRA training scripts).
- ``sd3-lora``: SD3's MMDiT (joint attention over image and text tokens, the last block context-pre-only) at width
  512 (8 heads of 64), 4 blocks, 16-channel 32 x 32 latents in 2 x 2 patches (256 image tokens, 77 text tokens of
  1024), batch 2, the flow-matching regression loss; frozen, with rank-16 adapters on the image and text
  attention projections.
- ``sd3-64``: the same MMDiT fully fine-tuned on 64 x 64 latents (1024 image tokens), batch 1.
- ``vae``: Stable Diffusion's AutoencoderKL layout (4 levels, 2 resnets each, attention in the mid blocks) at half
  its width (64, 128, 256, 256 channels), encode -> decode of a 128 x 128 image, batch 1; the reconstruction loss.

For each model: the un-checkpointed step, ``enable_gradient_checkpointing()`` (diffusers checkpoints every resnet
and transformer block, non-reentrant), and ckplan planned at the *measured* peak of diffusers' checkpointing.
Peaks are live tensor storages of one step (``measure_peak``: parameters, gradients, activations, the output kept
through backward), the same ruler for all three. Step times: ``--runs`` rounds of one step of each of the three
in turn after a warm-up round (``step_samples_ms``), in one process; overhead = a model's median step time over
the un-checkpointed median, minus 1, with the fastest .. slowest step. Re-run GFLOP: FLOPs of one step's backward
(``FlopCounterMode``: matmuls, convolutions, attention) minus the un-checkpointed backward's, i.e. the forward work
each checkpointing repeats, which does not depend on the machine's load.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path

import diffusers
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from planner import optimize  # noqa: E402
from planner.capture.inputs import as_inputs  # noqa: E402
from planner.common.budget import format_bytes  # noqa: E402
from planner.profiling.measure import measure_peak, step_samples_ms  # noqa: E402

Case = tuple[Callable[[], torch.nn.Module], dict[str, torch.Tensor], torch.Tensor]
"""A model factory, the keyword arguments of one training call, and the target of the loss."""


def unet() -> Case:
    def build() -> torch.nn.Module:
        return diffusers.UNet2DConditionModel(sample_size=32, block_out_channels=(64, 128, 256, 256),
                                              layers_per_block=2, cross_attention_dim=768, attention_head_dim=8,
                                              norm_num_groups=32)

    g = torch.Generator().manual_seed(0)
    batch = {"sample": torch.randn(2, 4, 32, 32, generator=g), "timestep": torch.tensor([10, 500]),
             "encoder_hidden_states": torch.randn(2, 77, 768, generator=g)}
    return build, batch, torch.randn(2, 4, 32, 32, generator=g)


def sd3(side: int = 32, rows: int = 2) -> Case:
    def build() -> torch.nn.Module:
        return diffusers.SD3Transformer2DModel(sample_size=side, patch_size=2, in_channels=16, out_channels=16,
                                               num_layers=4, attention_head_dim=64, num_attention_heads=8,
                                               joint_attention_dim=1024, caption_projection_dim=512,
                                               pooled_projection_dim=768, pos_embed_max_size=64)

    g = torch.Generator().manual_seed(0)
    batch = {"hidden_states": torch.randn(rows, 16, side, side, generator=g),
             "timestep": torch.tensor([10, 500][:rows]),
             "encoder_hidden_states": torch.randn(rows, 77, 1024, generator=g),
             "pooled_projections": torch.randn(rows, 768, generator=g)}
    return build, batch, torch.randn(rows, 16, side, side, generator=g)


def vae() -> Case:
    def build() -> torch.nn.Module:
        return diffusers.AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                                       up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(64, 128, 256, 256),
                                       layers_per_block=2, latent_channels=4, norm_num_groups=32, sample_size=128)

    image = torch.randn(1, 3, 128, 128, generator=torch.Generator().manual_seed(0))
    return build, {"sample": image}, image


UNET_LORA = ["to_k", "to_q", "to_v", "to_out.0"]
SD3_LORA = [*UNET_LORA, "add_k_proj", "add_q_proj", "add_v_proj", "to_add_out"]
MODELS: dict[str, tuple[Callable[[], Case], list[str] | None]] = {
    "unet": (unet, None), "unet-lora": (unet, UNET_LORA), "sd3-lora": (sd3, SD3_LORA),
    "sd3-64": (lambda: sd3(side=64, rows=1), None), "vae": (vae, None)}
"""Each model's case and, for LoRA fine-tuning, the modules that get adapters (diffusers' training scripts' targets:
the base frozen, rank 16)."""


def backward_flops(module: torch.nn.Module, batch: dict, loss_fn) -> int:
    loss = loss_fn(module(**batch))
    with FlopCounterMode(display=False) as counter:
        loss.backward()
    for p in module.parameters():
        p.grad = None
    return counter.get_total_flops()


def row(name: str, runs: int, time_limit_s: float) -> str:
    case, lora = MODELS[name]
    build, batch, target = case()

    def model_to_train() -> torch.nn.Module:
        torch.manual_seed(0)
        model = build().train()
        if lora is not None:
            from peft import LoraConfig

            model.requires_grad_(False)
            model.add_adapter(LoraConfig(r=16, lora_alpha=16, init_lora_weights="gaussian", target_modules=lora))
        return model

    def loss_fn(output) -> torch.Tensor:
        return F.mse_loss(output.sample, target)

    model, theirs = model_to_train(), model_to_train()
    theirs.enable_gradient_checkpointing()
    inputs = as_inputs(model, batch)
    base_peak = measure_peak(model, inputs, loss_fn)
    their_peak = measure_peak(theirs, inputs, loss_fn)
    start = time.perf_counter()
    plan = optimize(model, their_peak, inputs=batch, loss_fn=loss_fn, time_limit_s=time_limit_s)
    plan_s = time.perf_counter() - start
    our_peak = measure_peak(plan.module, inputs, loss_fn)
    plain = backward_flops(model, batch, loss_fn)
    their_flops, our_flops = (backward_flops(m, batch, loss_fn) - plain for m in (theirs, plan.module))
    samples = step_samples_ms([model, theirs, plan.module], inputs, loss_fn, runs=runs)
    base = statistics.median(samples[0])

    def overhead(times: list[float]) -> str:
        return (f"{statistics.median(times) / base - 1:+.1%} ({min(times) / base - 1:+.1%} .. "
                f"{max(times) / base - 1:+.1%})")

    params = sum(p.numel() for p in model.parameters()) / 1e6
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad) / 1e6
    saves = sum(len(s.saved_ops) for s in plan.segments)
    return (f"| {name} ({params:.1f}M, {trained:.2f}M trained) | {format_bytes(base_peak)}, {base:.0f} ms | "
            f"{format_bytes(their_peak)} | {format_bytes(our_peak)} ({format_bytes(plan.predicted_peak_bytes)} "
            f"predicted) | {overhead(samples[1])} | "
            f"{overhead(samples[2])} ({plan.predicted_overhead:+.1%} predicted) | {their_flops / 1e9:.1f} / "
            f"{our_flops / 1e9:.1f} | {len(plan.segments)} chains, {saves} kept ops, {plan.solver_status} | "
            f"{plan_s:.0f} s |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--time-limit", type=float, default=60.0, help="seconds ckplan's solve stage may take")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "diffusers.md"), help="'-': stdout only")
    args = parser.parse_args()
    threads = f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} " if "OMP_NUM_THREADS" in os.environ else ""
    head = ["# ckplan vs diffusers' gradient checkpointing", "",
            f"Command: `{threads}python bench/diffusers_report.py --models {args.models} --runs {args.runs} "
            f"--time-limit {args.time_limit:g}` on {platform.machine()} ({os.cpu_count()} cores), "
            f"{torch.get_num_threads()} thread(s), torch {torch.__version__}, diffusers {diffusers.__version__}, "
            f"peft {version('peft')}, CPU.", "",
            "ckplan is planned at the measured peak of diffusers' `enable_gradient_checkpointing()`. Overhead = median "
            f"step time over the un-checkpointed median, minus 1 ({args.runs} interleaved rounds; fastest .. slowest "
            "step). Re-run GFLOP: backward FLOPs minus the un-checkpointed backward's (diffusers / ckplan).", "",
            "| model | no checkpointing: peak, step | diffusers peak | ckplan peak | diffusers overhead | "
            "ckplan overhead | re-run GFLOP | plan | planning time |",
            "|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(head), flush=True)
    rows = []
    for name in args.models.split(","):
        rows.append(row(name, args.runs, args.time_limit))
        print(rows[-1], flush=True)
    if args.out != "-":
        Path(args.out).write_text("\n".join(head + rows) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
