"""Shared helpers: loading the bundled examples and running one comparable training step."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load_example(name: str) -> dict:
    """Runs ``examples/<name>.py`` and returns its namespace (model, inputs, loss_fn)."""
    return runpy.run_path(str(EXAMPLES / f"{name}.py"))


def training_step(module: torch.nn.Module, model: torch.nn.Module, inputs, loss_fn, *, seed: int = 0):
    """One step of ``module`` (which shares parameters and buffers with ``model``).

    Restores ``model``'s buffers and clears gradients first, so steps of the original and the
    planned module start from the same state. Returns (output, {param: grad}, {buffer: value}).
    """
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(seed)
    args, kwargs = (inputs, {}) if isinstance(inputs, tuple) else ((), inputs)
    output = module(*args, **kwargs)
    loss_fn(output).backward()
    output = output.detach() if isinstance(output, torch.Tensor) else output
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    for p in model.parameters():
        p.grad = None
    return output, grads, buffers


@pytest.fixture
def restore_buffers():
    """Snapshots a model's buffers; call the returned function with the model to restore them."""
    saved = {}

    def snapshot_or_restore(model: torch.nn.Module) -> None:
        if id(model) not in saved:
            saved[id(model)] = [(b, b.detach().clone()) for b in model.buffers()]
        else:
            with torch.no_grad():
                for b, v in saved[id(model)]:
                    b.copy_(v)

    return snapshot_or_restore
