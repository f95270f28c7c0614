"""What an optimizer keeps and what its step allocates, measured by running its own ``step()`` on meta copies.

``optimizer=`` takes the user's optimizer object, a name (``adamw``, ``adam``, ``sgd``, ``sgd-momentum``) or the
bytes of its state. For an object or a name, the optimizer's class runs two steps over meta copies of the
parameters it holds (their hyperparameters and groups as given) under the live-storage tracker: the first
creates its state (what it keeps), the larger of both steps' rises above that is what a step allocates while
it runs (foreach temporaries: on a GPU the implementation torch picks there, ``foreach``, runs). Nothing is
allocated and nothing of the user's optimizer changes. Optimizers whose step cannot run on meta tensors
(bitsandbytes' 8-bit kernels) are measured from their state if they already hold one, else refused with the
other two forms named.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from planner.common.loop import OptimizerState
from planner.errors import OptionError
from planner.profiling.allocator import AllocatorTrace
from planner.profiling.memtrack import LiveStorages, local_of

NAMED = {"adamw": (torch.optim.AdamW, {}), "adam": (torch.optim.Adam, {}), "sgd": (torch.optim.SGD, {"lr": 0.01}),
         "sgd-momentum": (torch.optim.SGD, {"lr": 0.01, "momentum": 0.9})}
"""The optimizers ``optimizer=`` takes by name, with torch's defaults (AdamW: two state tensors per parameter)."""
META = torch.device("meta")


def optimizer_state(optimizer: Any, model: nn.Module, *, device_type: str, shards: int = 1) -> OptimizerState | None:
    """What ``optimizer`` (an ``Optimizer``, a name of ``NAMED`` or bytes) keeps and allocates on one rank.

    Args:
        optimizer: the ``optimizer=`` option; None counts nothing.
        model: the model planned; a name optimizes its trainable parameters.
        device_type: where the step will run (``cuda`` steps run torch's foreach implementation).
        shards: the data-parallel ranks FSDP splits the state over (each rank's tensor-parallel part, if any).

    Raises:
        OptionError: an unknown name, a negative or non-integer byte count, another kind of object, or an
            optimizer whose step cannot be run on meta tensors before it holds any state.
    """
    if optimizer is None:
        return None
    if isinstance(optimizer, int) and not isinstance(optimizer, bool):
        if optimizer < 0:
            raise OptionError(f"optimizer={optimizer} bytes is negative: pass the bytes of its state (an int >= 0)")
        return OptimizerState(kind="optimizer", state_bytes=-(-optimizer // shards), description="as given")
    if isinstance(optimizer, str):
        key = optimizer.lower()
        if key not in NAMED:
            raise OptionError(f"unknown optimizer={optimizer!r}: use one of {', '.join(NAMED)}, the optimizer object "
                              "itself, or the bytes of its state (an int >= 0)")
        cls, hyper = NAMED[key]
        trainable = list(dict.fromkeys(p for p in model.parameters() if p.requires_grad))
        return _measured(cls, [{"params": trainable, **hyper}], hyper, device_type=device_type, shards=shards,
                         existing=None)
    if isinstance(optimizer, torch.optim.Optimizer):
        groups = [{**group, "params": [p for p in group["params"] if p.requires_grad]}
                  for group in optimizer.param_groups]
        return _measured(type(optimizer), groups, dict(optimizer.defaults), device_type=device_type, shards=shards,
                         existing=optimizer)
    raise OptionError(f"optimizer= takes a torch.optim.Optimizer, one of {', '.join(NAMED)}, or the bytes of its "
                      f"state, not {type(optimizer).__name__}")


def _measured(cls: type, groups: list[dict], defaults: dict, *, device_type: str, shards: int,
              existing: torch.optim.Optimizer | None) -> OptimizerState:
    params = [p for group in groups for p in group["params"]]
    try:
        state_bytes, step_bytes = _run_on_meta(cls, groups, defaults, device_type=device_type)
    except Exception as exc:  # the optimizer's own code: any error means it cannot step on meta tensors
        held = _held_state_bytes(existing) if existing is not None else 0
        if not held:
            raise OptionError(f"{cls.__name__}'s step cannot run on meta tensors to measure its state "
                              f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); pass "
                              f"optimizer= one of {', '.join(NAMED)} or the bytes of its state") from None
        state_bytes, step_bytes = held, 0
    unique = list(dict.fromkeys(params))
    param_bytes = sum(local_of(p).numel() * p.element_size() for p in unique)
    ratio = state_bytes / param_bytes if param_bytes else 0.0
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in params})
    description = f"{ratio:.3g} x {'/'.join(dtypes)} parameters" if params else "no trainable parameters"
    share = _shard_bytes(unique, shards) / param_bytes if param_bytes and shards > 1 else 1.0
    return OptimizerState(kind=cls.__name__, state_bytes=math.ceil(state_bytes * share),
                          step_bytes=math.ceil(step_bytes * share), description=description)


def _shard_bytes(params: list[nn.Parameter], shards: int) -> int:
    """The bytes of one rank's FSDP2 shards of ``params``: dim 0 padded to a multiple of ``shards``, split."""
    total = 0
    for p in params:
        local = local_of(p)  # a tensor-parallel rank's own part, which FSDP shards further
        rows = local.shape[0] if local.dim() else 1
        total += -(-rows // shards) * (local.numel() // max(rows, 1)) * local.element_size()
    return total


def _run_on_meta(cls: type, groups: list[dict], defaults: dict, *, device_type: str) -> tuple[int, int]:
    """(state bytes, bytes a step allocates beyond them) of ``cls`` over meta copies of ``groups``."""
    copies: dict[int, nn.Parameter] = {}
    meta_groups = []
    for group in groups:
        settings = {k: v for k, v in group.items() if k != "params"}
        if settings.get("fused"):  # no fused kernel on meta; the fused step allocates next to nothing
            settings.update(fused=None, foreach=False)
        elif device_type == "cuda" and settings.get("foreach") is None:
            settings["foreach"] = True  # what torch picks for CUDA tensors (meta ones get the for-loop)
        meta_params = []
        for p in group["params"]:
            if id(p) not in copies:
                copy = nn.Parameter(torch.empty_like(local_of(p), device=META))
                copy.grad = torch.empty_like(copy)
                copies[id(p)] = copy
            meta_params.append(copies[id(p)])
        meta_groups.append({**settings, "params": meta_params})
    host = AllocatorTrace("cpu" if device_type == "cpu" else META)  # its scalars are the device's memory there
    with LiveStorages(META) as tracker, host:
        for copy in copies.values():
            assert copy.grad is not None  # set above
            tracker.track(copy)
            tracker.track(copy.grad)
        optimizer = _construct(cls, meta_groups, defaults)
        before = tracker.mark()
        host.mark()
        optimizer.step()
        first_peak, kept = tracker.window_peak_bytes, tracker.mark()
        host.mark()
        optimizer.step()
        second_peak = tracker.window_peak_bytes
    state = kept - before
    scalars = 0
    if device_type == "cpu":  # the state's host scalars (AdamW's ``step``) live with the parameters there, and the
        # step makes more as it runs (Python numbers wrapped, ``step`` copied), some where no dispatcher looks
        host_state = sum(value.untyped_storage().nbytes() for values in optimizer.state.values()
                         for value in values.values() if isinstance(value, torch.Tensor) and value.device.type == "cpu")
        state += host_state
        first, second = (w.peak_bytes - w.start_bytes for w in host.windows)
        scalars = max(first - host_state, second, 0)  # the first step also made the state
    return state, max(first_peak - kept, second_peak - kept, 0) + scalars


def _construct(cls: type, groups: list[dict], defaults: dict) -> torch.optim.Optimizer:
    """``cls`` over ``groups`` (each carries its hyperparameters), with the constructor's other arguments from
    ``defaults`` where it takes them."""
    try:
        return cls(groups, **defaults)
    except TypeError:
        return cls(groups)


def _held_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors ``optimizer`` holds in its state, each storage once (scalars such as ``step`` live on
    the host and are left out)."""
    storages = {}
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                storage = local_of(value).untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())
