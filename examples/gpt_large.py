"""The GPT example (examples/gpt.py) at GPT-2-small width: 6 blocks of width 768, 12 heads, 256 tokens,
batch 4, a vocabulary of 8192 (GPT-2's 50257 would make the tied head and the logits outweigh the six
blocks). Its matmuls take milliseconds on one CPU core, as they do on a GPU at scale, so this is where
recompute time is worth planning: ``ckplan examples/gpt_large.py --budget 60%`` (parameters and their
gradients take 43% of its 865 MiB step, so 50% is below what any plan reaches).

One training step takes a few seconds on one CPU core; planning it (profile included) about a minute.
"""

import importlib.util
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

_spec = importlib.util.spec_from_file_location("ckplan_example_gpt_model", Path(__file__).with_name("gpt.py"))
gpt = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = gpt  # importable: torch.compile imports the module of the model's code
_spec.loader.exec_module(gpt)

CONFIG = gpt.Config(vocab=8192, context=256, width=768, heads=12, layers=6, dropout=0.1)
torch.manual_seed(0)
model = gpt.GPT(CONFIG)
_tokens = torch.randint(0, CONFIG.vocab, (4, CONFIG.context + 1))
inputs = (_tokens[:, :-1],)


def loss_fn(logits: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, CONFIG.vocab), _tokens[:, 1:].reshape(-1))
