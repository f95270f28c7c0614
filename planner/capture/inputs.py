"""The example inputs of ``model(...)``, normalised once: positional and keyword arguments; and any call's
arguments by parameter name (``bind``), which plans compare shapes by."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from planner.errors import InputError


@dataclass(frozen=True, kw_only=True, slots=True)
class Inputs:
    """Example inputs of ``model(...)``, split into positional and keyword arguments."""

    args: tuple
    kwargs: dict[str, Any]

    def cast(self, dtype: torch.dtype | None) -> Inputs:
        """These inputs with their floating tensors cast to ``dtype`` (as FSDP2's ``cast_forward_inputs``
        does); themselves for None."""
        if dtype is None:
            return self

        def to(value: Any) -> Any:
            return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value

        return Inputs(args=tuple(to(v) for v in self.args), kwargs={k: to(v) for k, v in self.kwargs.items()})

    def describe(self) -> tuple[str, ...]:
        """``name: dtype[shape]`` of each tensor input, for profiles and errors."""
        items = [(f"arg{i}", v) for i, v in enumerate(self.args)] + list(self.kwargs.items())
        return tuple(
            f"{name}: {str(v.dtype).removeprefix('torch.')}{list(v.shape)}" if isinstance(v, torch.Tensor)
            else f"{name}: {type(v).__name__}"
            for name, v in items
        )


def as_inputs(model: nn.Module, inputs: tuple | Mapping | torch.Tensor | None) -> Inputs:
    """Normalises ``inputs=`` (tuple, dict, single tensor, or the model's ``example_inputs``)."""
    if inputs is None:
        inputs = getattr(model, "example_inputs", None)
        if callable(inputs):
            inputs = inputs()
        if inputs is None:
            raise InputError(
                f"no example inputs for {type(model).__name__}: pass inputs=(x,) or inputs={{'name': x}} "
                "to optimize(), or give the model an `example_inputs` attribute"
            )
    if isinstance(inputs, torch.Tensor):
        return Inputs(args=(inputs,), kwargs={})
    if isinstance(inputs, Mapping):
        return Inputs(args=(), kwargs=dict(inputs))
    if isinstance(inputs, (tuple, list)):
        return Inputs(args=tuple(inputs), kwargs={})
    raise InputError(
        f"inputs must be a tuple of positional arguments or a dict of keyword arguments, "
        f"got {type(inputs).__name__}"
    )


def bind(module: nn.Module, args: tuple, kwargs: dict) -> dict[str, Any] | None:
    """The call's arguments by parameter name (``**kwargs`` flattened in), or None if they do not bind."""
    try:
        bound = inspect.signature(module.forward).bind(*args, **kwargs)
    except TypeError:
        return None
    named: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = bound.signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        elif kind is not inspect.Parameter.VAR_POSITIONAL:
            named[name] = value
    return named


def tensor_shapes(module: nn.Module, args: tuple, kwargs: dict) -> dict[str, tuple[int, ...]]:
    """Shape of each tensor argument of a call of ``module``, by parameter name."""
    return {name: tuple(value.shape) for name, value in (bind(module, args, kwargs) or {}).items()
            if isinstance(value, torch.Tensor)}
