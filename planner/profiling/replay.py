"""A planned module's training step replayed on meta tensors, for its allocation sequence.

What the CUDA caching allocator reserves depends on the order and sizes of a step's allocations and frees, which
a plan changes (its segments' re-runs, what it keeps). The planned module runs one step here with its parameters,
buffers and inputs swapped for meta copies (``torch.func.functional_call`` over the whole step, so that
backward's re-runs see them too): nothing is allocated, the model is left as it was, and ``LiveStorages``
records every storage the step makes and frees, as the device's allocator would be asked for them. Hugging Face's
mask code decides as eager code does (``planner.capture.masks``), and reads of tensor values are answered as
capture recorded them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from planner.capture.inputs import Inputs
from planner.capture.masks import eager_masks
from planner.capture.step import LossFn, untouched
from planner.compat.torch_private import tree_leaves, tree_map
from planner.profiling.measure import run_step
from planner.profiling.memtrack import LiveStorages
from planner.profiling.meta import (
    META,
    AnsweredReads,
    FlashAttention,
    MovesStayOnMeta,
    StrayTensorsToMeta,
    autocast_asked_of,
    to_meta,
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Allocations:
    """One step's allocation sequence as the dispatcher sees it."""

    events: list[tuple[int, int]]
    """``(key, bytes)`` for an allocation, ``(key, 0)`` for its free, in order; the parameters, buffers and inputs
    first (what ``planner.memory.caching.simulate_reserved`` replays)."""
    live_peak_bytes: int
    """The most bytes alive at once in it."""


@contextlib.contextmanager
def _flash_in_reruns() -> Iterator[None]:
    """``FlashAttention`` also where backward re-runs a checkpointed segment, which a torch function mode does not
    reach: ``F.scaled_dot_product_attention`` itself is swapped for the block (code looks it up when it calls)."""
    original, mode = F.scaled_dot_product_attention, FlashAttention()

    def flash(*args: Any, **kwargs: Any) -> Any:
        return mode.__torch_function__(original, (), args, kwargs)

    F.scaled_dot_product_attention = flash
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


class _Step(nn.Module):
    """Forward, loss and backward as one call, so that ``functional_call``'s meta tensors stay in place through
    backward (where checkpointed segments re-run)."""

    def __init__(self, module: nn.Module, loss_fn: LossFn | None, keep_output: bool) -> None:
        super().__init__()
        self.module = module
        self.loss_fn = loss_fn
        self.keep_output = keep_output

    def forward(self, *args: Any, **kwargs: Any) -> None:
        run_step(self.module, Inputs(args=args, kwargs=kwargs), self.loss_fn, keep_output=self.keep_output)


def step_allocations(module: nn.Module, inputs: Inputs, *, loss_fn: LossFn | None = None,
                     keep_output: bool = True, reads: Sequence[Any] = ()) -> Allocations:
    """The allocation sequence of one training step of ``module`` (a planned module, with its hooks), replayed
    on meta tensors; ``module`` is left as it was. ``reads``: the values the step reads of its tensors
    (``.item()``, ``bool(mask.all())``), which meta tensors do not have, in order, as capture recorded them
    (``planner.capture.aten.SCALAR_READS_KEY``)."""
    home = next((p.device for p in module.parameters()), torch.device("cpu"))
    copies: dict[int, Any] = {}  # one meta copy per tensor, so that tied weights stay tied

    def meta(value: Any) -> Any:
        return copies.setdefault(id(value), to_meta(value)) if isinstance(value, torch.Tensor) else value

    state = {f"module.{name}": meta(t) for name, t in
             [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]}
    args, kwargs = tree_map(meta, (inputs.args, inputs.kwargs))
    tracker = LiveStorages(META)
    tracker.events = []
    for t in [*state.values(), *tree_leaves((args, kwargs))]:
        if isinstance(t, torch.Tensor):
            tracker.track(t)
    step = _Step(module, loss_fn, keep_output)
    with untouched(module), eager_masks(inputs.kwargs), autocast_asked_of(home), _flash_in_reruns(), \
            MovesStayOnMeta(), StrayTensorsToMeta(home), AnsweredReads(list(reads)), tracker:
        torch.func.functional_call(step, state, tuple(args), kwargs, tie_weights=False, strict=False)
    return Allocations(events=tracker.events, live_peak_bytes=tracker.peak_bytes)
