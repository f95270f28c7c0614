"""What one training step is: the default loss, and leaving the model as it was found.

Shared by the capture (tier 2: one real forward), profile and measure stages, which
all run the user's model for real and must not change it.
"""

from __future__ import annotations

import contextlib
import reprlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from planner.compat.torch_private import tree_leaves
from planner.errors import ProfileError

LossFn = Callable[[Any], torch.Tensor]


def default_loss(output: Any) -> torch.Tensor:
    """``output.loss`` when the output has one (Hugging Face), else the sum of all floating outputs."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    floats = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not floats:
        got = (f"a tensor of dtype {str(output.dtype).removeprefix('torch.')}" if isinstance(output, torch.Tensor)
               else reprlib.repr(output))
        raise ProfileError(f"the model returned {got}, with no floating-point tensor to differentiate: return one "
                           "from forward, or pass loss_fn=(output -> scalar loss) (ckplan: define loss_fn in the "
                           "model file)")
    loss = sum(t.sum() for t in floats)
    assert isinstance(loss, torch.Tensor)  # floats is not empty, so sum() does not return its start, 0
    return loss


@contextmanager
def untouched(model: nn.Module) -> Iterator[None]:
    """Runs a block in training mode with no gradients allocated, then restores the
    model's buffers, gradients, RNG state and every module's train/eval flag."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    grads = [(p, p.grad) for p in model.parameters()]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    training = [(m, m.training) for m in model.modules()]
    for p, _ in grads:
        p.grad = None
    model.train()
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
        for p, grad in grads:
            p.grad = grad
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        for m, flag in training:
            m.training = flag


def sync(device: torch.device) -> None:
    """Waits for queued device work (CUDA), so wall-clock timings mean something."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def backward(loss: torch.Tensor) -> None:
    """``loss.backward()`` as a training loop under autocast runs it: outside the autocast context
    (PyTorch's recommendation), so autocast's cache of cast parameters is gone by then and each
    cast lives only as long as autograd keeps it."""
    device = loss.device.type
    if (device != "meta" and torch.is_autocast_enabled(device)) or torch.is_autocast_enabled("cpu"):
        torch.clear_autocast_cache()
        off = [torch.autocast(kind, enabled=False) for kind in dict.fromkeys((device, "cpu")) if kind != "meta"]
        with contextlib.ExitStack() as stack:
            for context in off:  # a replay on meta tensors has no autocast of its own to turn off
                stack.enter_context(context)
            loss.backward()
    else:
        loss.backward()


@contextmanager
def parameters_in(model: nn.Module, dtype: torch.dtype | None) -> Iterator[None]:
    """``model``'s floating parameters cast to ``dtype`` for the block, buffers untouched: the step FSDP2 runs
    under ``MixedPrecisionPolicy(param_dtype=dtype)``. Each parameter stays the same object; its data is
    swapped and put back afterwards. Nothing happens for ``dtype`` None."""
    swapped: list[tuple[nn.Parameter, torch.Tensor]] = []
    if dtype is not None:
        for p in model.parameters():  # each shared parameter once
            if p.is_floating_point() and p.dtype != dtype:
                swapped.append((p, p.data))
                p.data = p.data.to(dtype)
    try:
        yield
    finally:
        for p, data in reversed(swapped):
            p.data = data

