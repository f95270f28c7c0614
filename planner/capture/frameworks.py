"""The checkpointing frameworks build into models, which a planned model must not run on top of its plan.

Hugging Face models (``gradient_checkpointing_enable``, ``activation_checkpointing_enable``), diffusers models
(``enable_gradient_checkpointing``) and timm models (``set_grad_checkpointing``) checkpoint inside their own
forward when a flag on their layers is set (``gradient_checkpointing``, ``grad_checkpointing``). Trainer and TRL
call those methods from a config flag (TRL's ``SFTConfig`` defaults to it). Run together with a plan, both
checkpointings re-run the same layers: the step costs about a fifth more for the same memory.

ckplan owns the decision on a model it planned: the step it plans is the one without the framework's
checkpointing (``switched_off`` while capturing and profiling); a plan run by module hooks turns the flags off
on its module and answers those methods with a one-line warning instead of turning them on (``guard``);
``planner.disable`` gives the framework its methods and flags back.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

from torch import nn

FLAGS = ("gradient_checkpointing", "grad_checkpointing")
"""Module attributes by which Hugging Face / diffusers and timm layers checkpoint themselves when True."""
ENABLERS = {"gradient_checkpointing_enable": "Hugging Face's", "activation_checkpointing_enable": "Hugging Face's",
            "enable_gradient_checkpointing": "diffusers'", "set_grad_checkpointing": "timm's"}
"""The methods that turn a framework's checkpointing on, and whose it is (as the warning says it)."""


def _flagged(model: nn.Module) -> list[tuple[nn.Module, str]]:
    return [(module, flag) for module in model.modules() for flag in FLAGS
            if module.__dict__.get(flag) is True]


@contextlib.contextmanager
def switched_off(model: nn.Module) -> Iterator[None]:
    """The framework's checkpointing off in ``model`` for the duration, as it was after."""
    flagged = _flagged(model)
    for module, flag in flagged:
        setattr(module, flag, False)
    try:
        yield
    finally:
        for module, flag in flagged:
            setattr(module, flag, True)


class _Refusal:
    """Stands in for a framework's checkpointing method on a planned model: warns and leaves it off."""

    def __init__(self, root: nn.Module, name: str, guard: Guard) -> None:
        self.root, self.name, self.guard = root, name, guard

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        if self.name == "set_grad_checkpointing" and not (args[0] if args else kwargs.get("enable", True)):
            return getattr(type(self.root), self.name)(self.root, *args, **kwargs)  # turning it off: let it
        warnings.warn(f"ckplan: {type(self.root).__name__}.{self.name}() left {ENABLERS[self.name]} checkpointing "
                      "off: the model runs a ckplan plan and would checkpoint twice; to use it instead, call "
                      "planner.disable(model) first", stacklevel=2)
        return None


class Guard:
    """A planned module's framework checkpointing turned off and its enabling methods answered by ckplan;
    ``remove()`` gives both back."""

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        self.flagged = _flagged(root)
        for module, flag in self.flagged:
            setattr(module, flag, False)
        self.names = [name for name in ENABLERS if callable(getattr(type(root), name, None))]
        for name in self.names:
            root.__dict__[name] = _Refusal(root, name, self)

    def remove(self) -> None:
        for name in self.names:
            self.root.__dict__.pop(name, None)
        for module, flag in self.flagged:
            setattr(module, flag, True)
        self.names, self.flagged = [], []


def guard(root: nn.Module) -> Guard:
    """Turns the framework checkpointing of ``root`` (a planned module) off and answers its enabling methods."""
    unguard(root)
    return Guard(root)


def unguard(root: nn.Module) -> None:
    """Gives ``root`` its framework's checkpointing methods and flags back (the guard is found on ``root`` itself,
    a copy of a planned module included)."""
    found = next((value for value in root.__dict__.values() if isinstance(value, _Refusal) and value.root is root),
                 None)
    if found is not None:
        found.guard.remove()
