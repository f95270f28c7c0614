"""``use_cache`` in training, the way Hugging Face's gradient checkpointing handles it.

A Hugging Face causal LM returns a key/value cache unless told not to (``config.use_cache`` is True
by default), and users do not pass ``use_cache=False``. In training the cache is useless, and with
checkpointing every re-run would fill it again; ``torch.export`` refuses it in an output. Hugging
Face turns it off when gradient checkpointing is on and the model is training; ckplan does the same,
with a forward pre-hook on the shallowest module whose ``forward`` takes ``use_cache`` (a PEFT model's
root passes ``**kwargs`` down to the model that has it). It acts only while training with gradients,
so ``generate()`` and evaluation keep their cache.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Iterator

import torch
from torch import nn


def training_with_grad(module: nn.Module) -> bool:
    """Whether a call is a training step: the module trains and gradients are on (as Hugging Face's
    checkpointing decides)."""
    return module.training and torch.is_grad_enabled()


def use_cache_position(module: nn.Module) -> int | None:
    """Position of ``use_cache`` among ``module.forward``'s parameters (Hugging Face models), or None."""
    try:
        names = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return None
    return names.index("use_cache") if "use_cache" in names else None


def cache_owner(root: nn.Module) -> tuple[nn.Module, int] | None:
    """The shallowest module under ``root`` (itself included) whose forward takes ``use_cache``, with
    the parameter's position; None for models without one."""
    for module in root.modules():
        position = use_cache_position(module)
        if position is not None:
            return module, position
    return None


class NoCacheWhileTraining:
    """Forward pre-hook: ``use_cache=False`` in training calls. With ``warn``, warns once when the
    call itself asked for a cache (as Hugging Face does)."""

    def __init__(self, position: int, *, warn: bool) -> None:
        self.position = position
        self.warn = warn

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict):
        if not training_with_grad(module):
            return None
        positional = len(args) > self.position
        if self.warn and (args[self.position] if positional else kwargs.get("use_cache")):
            self.warn = False
            warnings.warn("use_cache=True does not combine with activation checkpointing: ckplan turns the cache "
                          "off while training, as Hugging Face's gradient checkpointing does", stacklevel=2)
        if positional:
            return (*args[:self.position], False, *args[self.position + 1:]), kwargs
        return args, {**kwargs, "use_cache": False}


def install_no_cache(root: nn.Module, *, warn: bool) -> torch.utils.hooks.RemovableHandle | None:
    """Puts ``NoCacheWhileTraining`` on ``root``'s cache owner; its handle, or None without one."""
    owner = cache_owner(root)
    if owner is None:
        return None
    module, position = owner
    return module.register_forward_pre_hook(NoCacheWhileTraining(position, warn=warn), with_kwargs=True, prepend=True)


@contextlib.contextmanager
def no_cache(root: nn.Module) -> Iterator[None]:
    """``use_cache`` off in ``root``'s training calls while capturing and profiling (no warning)."""
    handle = install_no_cache(root, warn=False)
    try:
        yield
    finally:
        if handle is not None:
            handle.remove()
