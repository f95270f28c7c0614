"""The setting every capture and profile of a training step runs in, in one place.

``prepare``, ``profile`` and each shape group of a plan that follows the batch run the user's model as a planned
model trains: ``use_cache`` off in training calls (as Hugging Face's checkpointing turns it off), the model's own
checkpointing off (the plan replaces it), floating parameters in FSDP2's compute dtype, and under the autocast
of the training loop, whatever autocast the caller runs in (a trainer that meets a new shape group inside its own
``torch.autocast`` plans it as the loop was described).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from planner.capture.cache import no_cache
from planner.capture.frameworks import switched_off
from planner.capture.step import parameters_in


def device_type(model: nn.Module) -> str:
    """Where ``model``'s parameters are (``cpu`` for a model without any)."""
    return next((p.device.type for p in model.parameters()), "cpu")


def ambient_autocast(model: nn.Module) -> torch.dtype | None:
    """The dtype of the ``torch.autocast`` the caller runs in on ``model``'s device, None outside one."""
    kind = device_type(model)
    if kind == "meta" or not torch.is_autocast_enabled(kind):
        return None
    return torch.get_autocast_dtype(kind)


def _autocast_nesting() -> int:
    """How many ``torch.autocast`` contexts are open in this thread (torch has no getter: one in and out)."""
    nesting = torch.autocast_increment_nesting() - 1
    torch.autocast_decrement_nesting()
    return nesting


@contextlib.contextmanager
def autocast_nesting_kept() -> Iterator[None]:
    """After the block, as many ``torch.autocast`` contexts open as before it, and autocast's cache of parameter
    casts cleared where none is. make_fx's tracing of a forward that enters ``torch.autocast`` itself (Qwen2's
    rotary embedding turns it off) can leave two entries unmatched, and an autocast that never closes keeps every
    parameter's cast alive for the rest of the process (measured: a bf16 copy of the weights, 0.29 MB on a tiny
    Qwen2, alive through every later step)."""
    before = _autocast_nesting()
    try:
        yield
    finally:
        extra = _autocast_nesting() - before
        for _ in range(max(0, extra)):
            if torch.autocast_decrement_nesting() == 0:
                torch.clear_autocast_cache()


@contextlib.contextmanager
def as_trained(model: nn.Module, *, autocast: torch.dtype | None = None,
               param_dtype: torch.dtype | None = None) -> Iterator[None]:
    """The block runs ``model`` as a planned model trains (the module docstring): under ``autocast`` (a dtype) and
    no other, with the floating parameters in ``param_dtype`` where given."""
    kind = device_type(model)
    with contextlib.ExitStack() as stack:
        stack.enter_context(autocast_nesting_kept())
        stack.enter_context(no_cache(model))
        stack.enter_context(switched_off(model))
        stack.enter_context(parameters_in(model, param_dtype))
        if kind != "meta":  # meta has no autocast of its own
            stack.enter_context(torch.autocast(kind, enabled=False))
            if autocast is not None:
                stack.enter_context(torch.autocast(kind, dtype=autocast))
        yield
