"""Capture + profile time and graph size of real models on this machine.

    python bench/capture_profile_speed.py          # writes bench/results/capture_profile.md

The bar it checks: a 6-layer GPT-2 (n_embd 512, batch 4, sequence 256) captured and
profiled in under 60 s on a 2-core CPU.
"""

from __future__ import annotations

import os
import runpy
import sys
import time
from pathlib import Path

import torch
import transformers

from planner.capture.api import capture
from planner.capture.inputs import as_inputs
from planner.profiling.memory_pass import profile

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from zoo import MobileNetV2, ResNet18, ViT, images, labels_loss  # noqa: E402


def hf(model_cls, config, batch, seq, **extra):
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    return model_cls(config), {"input_ids": ids, "labels": ids, **extra}, None


def models():
    yield "gpt2 6x512, b4 x 256 (target)", lambda: hf(transformers.GPT2LMHeadModel, transformers.GPT2Config(
        n_layer=6, n_embd=512, n_head=8, vocab_size=50257, n_positions=1024), 4, 256, use_cache=False)
    yield "gpt2 4x128", lambda: hf(transformers.GPT2LMHeadModel, transformers.GPT2Config(
        n_layer=4, n_embd=128, n_head=4, vocab_size=1000, n_positions=128, bos_token_id=0, eos_token_id=0),
        4, 128, use_cache=False)
    yield "llama 4x128", lambda: hf(transformers.LlamaForCausalLM, transformers.LlamaConfig(
        vocab_size=1000, hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256), 4, 128, use_cache=False)
    yield "bert 4x128", lambda: hf(transformers.BertForMaskedLM, transformers.BertConfig(
        vocab_size=1000, hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        max_position_embeddings=256), 4, 128)
    yield "resnet18-like", lambda: (ResNet18(8), images(16, 128), labels_loss(16))
    yield "mobilenetv2-like", lambda: (MobileNetV2(), images(16, 64), labels_loss(16))
    yield "vit-like", lambda: (ViT(), images(16, 32), labels_loss(16))
    for name in ("seed_cnn", "gpt", "resnet"):
        yield f"examples/{name}.py", lambda name=name: (lambda ns: (ns["model"], ns["inputs"], ns["loss_fn"]))(
            runpy.run_path(str(ROOT / "examples" / f"{name}.py")))


def main() -> None:
    torch.manual_seed(0)
    lines = ["# Capture and profile time", "",
             f"`python bench/capture_profile_speed.py` on {os.cpu_count()} CPU cores, torch {torch.__version__}, "
             f"transformers {transformers.__version__}.", "",
             "| model | capture | nodes | capture s | profile s | total s |", "|---|---|---|---|---|---|"]
    for name, build in models():
        model, inputs, loss_fn = build()
        model.train()
        example = as_inputs(model, inputs)
        started = time.perf_counter()
        captured = capture(model, example)
        captured_s = time.perf_counter() - started
        measured = profile(captured, model, example, loss_fn=loss_fn)
        total = time.perf_counter() - started
        lines.append(f"| {name} | {captured.method.label} | {len(measured.nodes)} | {captured_s:.1f} | "
                     f"{total - captured_s:.1f} | {total:.1f} |")
        print(lines[-1], flush=True)
    out = ROOT / "bench" / "results" / "capture_profile.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
