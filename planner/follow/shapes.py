"""The shapes a plan that follows the batch groups calls by, and the shapes a user asks to plan ahead.

A call's shapes are its tensor arguments by parameter name, each with its shape (``Shapes``, sorted by name).
``ShapeGrid`` rounds each dim of each argument up to the next line of a grid whose lines are a sixteenth of
the example batch's size apart and pass through the example's size: calls in one cell form a group, planned
once for the cell's upper shapes. A shape to plan ahead (``ShapeSpec``) is a tuple given to every tensor
argument shaped like the example's largest (an LM's ``input_ids``, ``attention_mask`` and ``labels``), or a
``{argument: shape}`` dict; it is realised from the example batch's own values (``realize``). A
``ShapeRange`` plans ahead every group between two such shapes (``ShapeGrid.covering``).
"""

from __future__ import annotations

import itertools
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

MAX_RANGE_GROUPS = 64
"""The most groups a ``ShapeRange`` may cover: past it a typo such as ``1x8..64x4096`` would plan for hours."""


@dataclass(frozen=True, slots=True)
class ShapeRange:
    """Every shape from ``low`` to ``high``, dim by dim, for the arguments shaped like the example's largest:
    planned ahead as the groups that cover it (``optimize(..., shapes=[ShapeRange((4, 64), (4, 512))])``,
    ``ckplan --shapes 4x64..4x512``)."""

    low: tuple[int, ...]
    high: tuple[int, ...]

    def __post_init__(self) -> None:
        """Checks that both ends are shapes of one rank with ``low <= high`` in every dim.

        Raises:
            OptionError: they are not.
        """
        low, high = (_dims(end, f"ShapeRange's {which}") for end, which in ((self.low, "low"), (self.high, "high")))
        if len(low) != len(high) or any(a > b for a, b in zip(low, high)):
            raise OptionError(f"ShapeRange{(low, high)} must run from a smaller shape to a larger one of as many "
                              f"dims, e.g. ShapeRange((4, 64), (4, 512))")
        object.__setattr__(self, "low", low)
        object.__setattr__(self, "high", high)

    def __str__(self) -> str:
        return f"{'x'.join(map(str, self.low))}..{'x'.join(map(str, self.high))}"


OneShape = tuple[int, ...] | Mapping[str, tuple[int, ...]]
"""One shape to plan ahead: for the arguments shaped like the example's largest, or one per argument."""

ShapeSpec = OneShape | ShapeRange
"""Shapes to plan ahead: one, or a range of shapes for the arguments shaped like the example's largest."""


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
        """The group of a call with these tensor shapes (its upper shapes). A call may leave out tensor
        arguments the example had (a batch without ``attention_mask``: its own group) or pass ones it did not
        (rounded as an argument of the example shaped like them, else grouped by their exact shape); None when
        an argument has another number of dims than the example's."""
        if any(name in self.steps and len(shape) != len(self.steps[name]) for name, shape in shapes.items()):
            return None
        return tuple((name, self._upper(self._like(name, shapes), tuple(shapes[name]))) for name in sorted(shapes))

    def _like(self, name: str, shapes: Mapping[str, tuple[int, ...]]) -> str | None:
        """The argument whose grid lines ``name``'s shape is rounded to: its own, else (an argument the example
        lacked, such as an ``attention_mask`` beside ``input_ids``) one of the example's shaped as it is in this
        call, else None (grouped by its exact shape)."""
        if name in self.steps:
            return name
        return next((other for other in sorted(self.steps) if other in shapes and shapes[other] == shapes[name]), None)

    def _upper(self, name: str | None, shape: tuple[int, ...]) -> tuple[int, ...]:
        """``shape`` rounded up to the grid lines of argument ``name`` (as it is for None)."""
        if name is None:
            return shape
        return tuple(a + math.ceil((d - a) / s) * s for d, a, s in zip(shape, self.anchors[name], self.steps[name]))

    def covering(self, name: str, span: ShapeRange) -> list[tuple[int, ...]]:
        """The upper shapes, for argument ``name``, of the groups that cover every shape in ``span``: in each
        dim, the grid lines from the one ``span.low`` rounds up to, to the one ``span.high`` rounds up to.

        Raises:
            OptionError: ``span`` has another rank than the argument, or covers more than ``MAX_RANGE_GROUPS``.
        """
        anchors, steps = self.anchors[name], self.steps[name]
        if len(span.low) != len(anchors):
            raise OptionError(f"shapes range {span} has {len(span.low)} dims, but the example's {name} has "
                              f"{len(anchors)} {anchors}; give it {len(anchors)} dims")
        lines = [range(a + math.ceil((lo - a) / s) * s, a + math.ceil((hi - a) / s) * s + 1, s)
                 for lo, hi, a, s in zip(span.low, span.high, anchors, steps)]
        count = math.prod(len(line) for line in lines)
        if count > MAX_RANGE_GROUPS:
            raise OptionError(f"shapes range {span} covers {count} shape groups ("
                              f"{' x '.join(str(len(line)) for line in lines)}); plan at most {MAX_RANGE_GROUPS} "
                              "ahead: narrow the range or list the shapes (the rest are planned when first seen)")
        return [tuple(shape) for shape in itertools.product(*lines)]


def shaped(values: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """The shapes of a call's tensor arguments that have dims (a 0-d one, such as Trainer's
    ``num_items_in_batch``, has no size to follow)."""
    return {name: tuple(v.shape) for name, v in values.items() if isinstance(v, torch.Tensor) and v.dim() > 0}


def _dims(value: Any, where: str) -> tuple[int, ...]:
    """``value`` as a shape (a tuple of positive ints).

    Raises:
        OptionError: it is not one.
    """
    if isinstance(value, str | bytes) or not hasattr(value, "__iter__"):
        raise OptionError(f"{where} must be a shape such as (4, 128), got {value!r}")
    shape = tuple(value)
    if not shape or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in shape):
        raise OptionError(f"{where} must be a shape of positive ints such as (4, 128), got {value!r}")
    return shape


def check_spec(spec: Any) -> ShapeSpec:
    """``spec`` as a ``ShapeSpec`` (tuples of ints, or a ``ShapeRange``, which checked itself).

    Raises:
        OptionError: not a sequence of positive ints, nor a dict of them by argument name.
    """
    if isinstance(spec, ShapeRange):
        return spec
    if isinstance(spec, Mapping):
        return {str(name): _dims(value, f"shapes[...][{name!r}]") for name, value in spec.items()}
    return _dims(spec, "each of shapes=")


def spread(spec: ShapeSpec, grid: ShapeGrid, example: Mapping[str, Any]) -> list[OneShape]:
    """``spec`` as the shapes to plan: a range as the upper shape of each group covering it (``covering``, on the
    grid of the example's largest argument), any other shape as itself.

    Raises:
        OptionError: as ``ShapeGrid.covering``.
    """
    if not isinstance(spec, ShapeRange):
        return [spec]
    tensors = shaped(example)
    largest = max(tensors.values(), key=math.prod)
    return list(grid.covering(next(name for name, shape in tensors.items() if shape == largest), spec))


def realize(spec: OneShape, example: Mapping[str, Any]) -> dict[str, Any]:
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
