"""Selective checkpointing under ``torch.autocast``, working around pytorch#193338.

Autocast caches each parameter's cast for as long as its outermost ``torch.autocast`` is open, so a checkpointed
segment's forward and its re-run dispatch different numbers of ``_to_copy`` ops; SAC numbers the ops of each kind
and pairs forward and re-run by number (``autocast_safe`` says more). Used by the executors' SAC contexts
(``planner.rewrite.sac``, ``planner.rewrite.chains``) and by the profile's measurement of SAC's cost.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from planner.compat.torch_private import TorchDispatchMode

_TO_COPY = torch.ops.aten._to_copy.default


def is_parameter_cast(func: Any, args: tuple) -> bool:
    """Whether an op is a cast of a parameter (a leaf that requires grad): what autocast caches."""
    return func is _TO_COPY and bool(args) and isinstance(args[0], torch.Tensor) and args[0].is_leaf and \
        args[0].requires_grad


class _ParameterCastsAside(TorchDispatchMode):
    """SAC's dispatch mode ``inner`` with autocast's casts of parameters kept out of it.

    Autocast caches each parameter's cast for as long as its outermost ``torch.autocast`` is open, so a segment's
    forward and its re-run dispatch different numbers of ``_to_copy`` ops: a parameter cast already cached skips
    the op in one and not in the other (a backward run inside the forward's ``torch.autocast`` re-runs with the
    forward's casts cached; one run outside starts with none). SAC numbers the ops of each kind in both and pairs
    them by number, so every later ``_to_copy`` of the segment would be paired with another's output, or fail
    with "invocation index N ... not found in storage" (pytorch#193338). Parameter casts are never saved (the
    memory model keeps autocast's cache out of the save candidates), so they run here past SAC, uncounted, in
    both; ``seen`` hears of each in the forward (a policy that numbers ops by name counts them as the profile
    did)."""

    def __init__(self, inner: Any, seen: Callable[[Any], None] | None = None) -> None:
        super().__init__()
        self.inner, self.seen = inner, seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if is_parameter_cast(func, args):
            if self.seen is not None:
                self.seen(func)
            return func(*args, **kwargs)
        return self.inner.__torch_dispatch__(func, types, args, kwargs)


def autocast_safe(forward: Any, recompute: Any, seen: Callable[[Any], None] | None = None) -> tuple[Any, Any]:
    """SAC's (forward, re-run) modes, each with autocast's parameter casts kept out of it where the forward runs
    under ``torch.autocast`` (``_ParameterCastsAside``); as they are outside one."""
    if not (torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")):
        return forward, recompute
    return _ParameterCastsAside(forward, seen), _ParameterCastsAside(recompute)
