"""The first batch of a training loader, taken without changing what training will see."""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from planner.compat.torch_private import tree_map


def first_batch(loader: Iterable) -> Any:
    """The loader's first batch from an iterator of its own, with every random generator a sampler or collator may
    draw from (torch's, CUDA's, Python's, numpy's) put back after: the training run draws the same batches as
    without ckplan."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    try:
        with torch.random.fork_rng(devices=cuda):
            return next(iter(loader))
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor in it on ``device``; a mapping (a collator's ``BatchEncoding``) becomes a dict."""
    if isinstance(batch, Mapping):
        batch = dict(batch)
    return tree_map(lambda value: value.to(device) if isinstance(value, torch.Tensor) else value, batch)
