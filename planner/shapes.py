"""The shapes a plan that follows the batch groups calls by, and the shapes a user asks to plan ahead.

A call's shapes are its tensor arguments by parameter name, each with its shape (``Shapes``, sorted by name).
``ShapeGrid`` rounds each dim of each argument up to the next line of a grid whose lines are a sixteenth of
the example batch's size apart and pass through the example's size: calls in one cell form a group, planned
once for the cell's upper shapes. A shape to plan ahead (``ShapeSpec``) is a tuple given to every tensor
argument shaped like the example's largest (an LM's ``input_ids``, ``attention_mask`` and ``labels``), or a
``{argument: shape}`` dict; it is realised from the example batch's own values (``realize``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from planner.errors import OptionError

GROUPS_PER_DIM = 16
"""How many groups the example's size of each dim is split into (the grid's step is its 1/16th)."""

Shapes = tuple[tuple[str, tuple[int, ...]], ...]
"""A call's tensor arguments by name (sorted), each with its shape: also a group's key (its upper shapes)."""

ShapeSpec = tuple[int, ...] | Mapping[str, tuple[int, ...]]
"""A shape to plan ahead: one shape for the arguments shaped like the example's largest, or one per argument."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ShapeGrid:
    """How call shapes are grouped: each dim of each tensor argument rounded up to the next grid line, the
    lines ``step`` apart and passing through the example batch's size (so the example is its own group's
    upper shape, and the plan made for it is that group's)."""

    anchors: dict[str, tuple[int, ...]]
    """Per tensor argument (by parameter name): the example's shape."""
    steps: dict[str, tuple[int, ...]]
    """Per tensor argument: the step of each of its dims."""

    @classmethod
    def around(cls, shapes: Mapping[str, tuple[int, ...]], groups: int = GROUPS_PER_DIM) -> ShapeGrid:
        """The grid for calls like one whose tensor arguments have these shapes (the example batch)."""
        return cls(anchors={name: tuple(shape) for name, shape in shapes.items()},
                   steps={name: tuple(max(1, math.ceil(d / groups)) for d in shape) for name, shape in shapes.items()})

    def group(self, shapes: Mapping[str, tuple[int, ...]]) -> Shapes | None:
        """The group of a call with these tensor shapes (its upper shapes); None when its tensor arguments are
        not the ones the grid was made for (other names or ranks)."""
        if set(shapes) != set(self.steps) or any(len(shapes[k]) != len(s) for k, s in self.steps.items()):
            return None
        return tuple((name, tuple(a + math.ceil((d - a) / s) * s
                                  for d, a, s in zip(shapes[name], self.anchors[name], self.steps[name])))
                     for name in sorted(shapes))


def shaped(values: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """The shapes of a call's tensor arguments that have dims (a 0-d one, such as Trainer's
    ``num_items_in_batch``, has no size to follow)."""
    return {name: tuple(v.shape) for name, v in values.items() if isinstance(v, torch.Tensor) and v.dim() > 0}


def check_spec(spec: Any) -> ShapeSpec:
    """``spec`` as a ``ShapeSpec`` (tuples of ints).

    Raises:
        OptionError: not a sequence of positive ints, nor a dict of them by argument name.
    """
    def dims(value: Any, where: str) -> tuple[int, ...]:
        if isinstance(value, str | bytes) or not hasattr(value, "__iter__"):
            raise OptionError(f"{where} must be a shape such as (4, 128), got {value!r}")
        shape = tuple(value)
        if not shape or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in shape):
            raise OptionError(f"{where} must be a shape of positive ints such as (4, 128), got {value!r}")
        return shape
    if isinstance(spec, Mapping):
        return {str(name): dims(value, f"shapes[...][{name!r}]") for name, value in spec.items()}
    return dims(spec, "each of shapes=")


def realize(spec: ShapeSpec, example: Mapping[str, Any]) -> dict[str, Any]:
    """The example call's values (tensor arguments by name) cut or grown to ``spec``: each dim that is
    longer cut to its first rows, each that is shorter grown by repeating its last slice.

    Raises:
        OptionError: ``spec`` names an argument the example does not have, or has another rank.
    """
    tensors = shaped(example)
    if isinstance(spec, Mapping):
        unknown = sorted(set(spec) - set(tensors))
        if unknown:
            raise OptionError(f"shapes= names {unknown[0]!r}, which is not a tensor argument of the example "
                              f"({', '.join(sorted(tensors))})")
        wanted = dict(spec)
    else:
        largest = max(tensors.values(), key=math.prod)
        wanted = {name: spec for name, shape in tensors.items() if shape == largest}
    for name, shape in wanted.items():
        if len(shape) != len(tensors[name]):
            raise OptionError(f"shapes= gives {name} the shape {tuple(shape)}, but the example's {name} has "
                              f"{len(tensors[name])} dims {tensors[name]}; give it {len(tensors[name])} dims")
    return {name: fitted(value, wanted.get(name)) for name, value in example.items()}


def fitted(value: Any, shape: tuple[int, ...] | None) -> Any:
    """``value`` cut or grown to ``shape`` (see ``realize``); anything else, or None for ``shape``, as it is."""
    if not isinstance(value, torch.Tensor) or shape is None or tuple(value.shape) == shape:
        return value
    for dim, size in enumerate(shape):
        if size < value.shape[dim]:
            value = value.narrow(dim, 0, size)
        elif size > value.shape[dim]:
            short = size - value.shape[dim]
            edge = value.narrow(dim, value.shape[dim] - 1, 1)
            value = torch.cat([value, edge.expand(*[short if d == dim else -1 for d in range(value.dim())])], dim)
    return value
