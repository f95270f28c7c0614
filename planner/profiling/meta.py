"""Estimates a training step's profile for a device that is not here, without allocating it.

The same memory pass as a measured profile (``recorder.MemoryRecorder``: live storages, what
autograd saves, per-node peaks) runs on meta tensors, which have sizes but no data; the
per-node times come from the device spec's roofline (``estimate.Roofline``) instead of a
clock. A model on the meta device is used as it is; a real model has its parameters and
buffers swapped for meta copies during the pass (and back afterwards), so nothing of the
step is ever allocated.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from planner.capture.api import Captured
from planner.capture.aten import SCALAR_READS_KEY
from planner.capture.inputs import Inputs
from planner.capture.step import LossFn, default_loss, untouched
from planner.capture.tree import meta_copy
from planner.compat.torch_private import TorchDispatchMode, disable_current_modes, parse_to, tree_leaves, tree_map
from planner.profiling.devices import DeviceSpec
from planner.profiling.estimate import Roofline
from planner.profiling.memory_pass import (
    StepTimes,
    assemble,
    check_trainable,
    device_of,
    eager_excess_of,
)
from planner.profiling.record import Profile
from planner.profiling.recorder import MemoryRecorder
from planner.profiling.workspace import cpu_workspace_bytes

META = torch.device("meta")


def estimate(captured: Captured, model: nn.Module, inputs: Inputs, *, spec: DeviceSpec,
             loss_fn: LossFn | None = None, keep_output: bool = True) -> Profile:
    """The profile of one training step of ``captured`` on the device ``spec`` describes.

    Memory is the meta-tensor replay of the step; times are roofline estimates. The model
    is left as it was (parameters, buffers, gradients, modes).

    Raises:
        ProfileError: a node failed on meta tensors (naming it), e.g. one that reads tensor
            values (``.item()``, data-dependent shapes) which meta tensors do not have.
    """
    roofline = Roofline(spec)
    replay = memory_on_meta(captured, model, inputs, loss_fn=loss_fn, keep_output=keep_output, op_ms=roofline.op_ms,
                            op_workspace=cpu_workspace_bytes if spec.kind == "cpu" else None)
    recorder = replay.recorder
    count = len(recorder.records)
    fwd = [recorder.est_fwd_ms[i] for i in range(count)]
    bwd = [recorder.est_bwd_ms[i] for i in range(count)]
    times = StepTimes(fwd_ms=fwd, bwd_ms=bwd, step_fwd_ms=sum(fwd), step_bwd_ms=sum(bwd),
                      checkpoint_overhead_ms=spec.checkpoint_overhead_us / 1e3)
    return assemble(recorder, captured, model, replay.example, times=times, excess=replay.excess, device=spec.name,
                    estimated_for=spec.name, host_link=spec.host_link, device_kind=spec.kind)


@dataclass(frozen=True, kw_only=True, slots=True)
class MetaReplay:
    """The memory pass of one step replayed on meta tensors (``memory_on_meta``)."""

    recorder: MemoryRecorder
    """What the pass recorded: storages, saves, per-node live bytes (exact: sizes are all a meta tensor has)."""
    example: Inputs
    """The inputs as meta tensors."""
    excess: list[int] | None
    """Per node, what the model's own forward keeps beyond the graph (``memory_pass.eager_excess_of``)."""


def memory_on_meta(captured: Captured, model: nn.Module, inputs: Inputs, *, loss_fn: LossFn | None = None,
                   keep_output: bool = True, op_ms: Callable[[Any, tuple, Any], float] | None = None,
                   eager: bool = True, op_workspace: Callable[[Any, tuple, Any], int] | None = None) -> MetaReplay:
    """The memory pass of one training step of ``captured`` on meta tensors: nothing is allocated, and the
    model is left as it was (the pass runs on a copy of its module tree with meta tensors, ``meta_copy``).
    ``op_ms``: a per-op time estimate to record as it goes (the roofline), if any; ``op_workspace``: a per-op
    estimate of what it allocates inside itself (``planner.profiling.workspace``), if any. ``eager``: also run the
    model's own forward on meta to measure what its Python locals keep (``MetaReplay.excess``); a forward
    that reads values (a ``.item()``) cannot run there, so a caller that knows the excess otherwise skips it.

    Raises:
        ProfileError: a node failed on meta tensors (naming it), e.g. one that reads tensor values.
    """
    loss_fn = loss_fn or default_loss
    check_trainable(model)
    reads = captured.graph_module.meta.get(SCALAR_READS_KEY, [])
    home = device_of(model, inputs)
    graph, tree = meta_copy(captured.graph_module, model, convert=to_meta)  # the model itself is never touched
    assert isinstance(graph, fx.GraphModule)  # a clone keeps its class
    with untouched(tree), FlashAttention(), MovesStayOnMeta(), StrayTensorsToMeta(home), autocast_asked_of(home):
        copies: dict[int, Any] = {}  # one copy per tensor: labels=input_ids is one tensor, counted once
        args, kwargs = tree_map(lambda v: copies.setdefault(id(v), to_meta(v)), (inputs.args, inputs.kwargs))
        example = Inputs(args=args, kwargs=kwargs)
        recorder = MemoryRecorder(graph, tree, META, op_ms=op_ms, keep_output=keep_output, op_workspace=op_workspace)
        with AnsweredReads(reads):
            recorder.step(example, loss_fn)
        with AnsweredReads(reads):
            excess = eager_excess_of(recorder, captured, tree, example) if eager else None
    return MetaReplay(recorder=recorder, example=example, excess=excess)


def to_meta(value: Any, *, keep_grad: bool = True) -> Any:
    """A meta tensor like ``value`` (same shape, strides, dtype and, with ``keep_grad``,
    requires_grad); any other value as it is."""
    if not isinstance(value, torch.Tensor) or value.is_meta:
        return value
    with disable_current_modes():  # a conversion is not memory of the step
        nbytes, itemsize = value.untyped_storage().nbytes(), value.element_size()
        if nbytes % itemsize == 0:  # a view keeps the size of the whole storage it views
            meta = torch.empty(nbytes // itemsize, dtype=value.dtype, device=META).as_strided(
                value.size(), value.stride(), value.storage_offset())
        else:
            meta = torch.empty_strided(value.size(), value.stride(), dtype=value.dtype, device=META)
    if isinstance(value, nn.Parameter):
        return nn.Parameter(meta, requires_grad=value.requires_grad)
    return meta.requires_grad_(value.requires_grad) if keep_grad and value.requires_grad else meta


@contextlib.contextmanager
def autocast_asked_of(home: torch.device) -> Iterator[None]:
    """``torch.is_autocast_enabled`` and ``torch.get_autocast_dtype`` asked of the meta device answer for
    ``home``, where the replayed step runs: torch has no autocast state for meta and raises, and code that asks
    of its tensors' device (TRL's chunked LM-head Function) would fail on meta copies. No torch function mode
    sees these calls, so the two functions are swapped for the replay and put back after."""
    enabled, dtype = torch.is_autocast_enabled, torch.get_autocast_dtype
    home_type = "cpu" if home.type == "meta" else home.type

    def is_enabled(*args: Any) -> bool:
        if args and str(args[0]) == "meta":
            return enabled(home_type)
        return enabled(*args)

    def autocast_dtype(device_type: str) -> torch.dtype:
        return dtype(home_type if device_type == "meta" else device_type)

    torch.is_autocast_enabled, torch.get_autocast_dtype = is_enabled, autocast_dtype  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.is_autocast_enabled, torch.get_autocast_dtype = enabled, dtype


class AnsweredReads(TorchDispatchMode):
    """Answers the reads of a meta tensor's value (``bool(mask.all())``, ``.item()``), which has none, with the
    values the captured forward read at the same points (``capture.aten.SCALAR_READS_KEY``), in order: the
    replay takes the paths the real forward took."""

    def __init__(self, values: list) -> None:
        super().__init__()
        self.values = iter(values)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:
            answer = next(self.values, None)
            if answer is not None:
                return answer
        return func(*args, **(kwargs or {}))


class StrayTensorsToMeta(TorchDispatchMode):
    """Runs an op that mixes meta and real tensors (a loss's labels, a constant made on the CPU
    inside ``forward``) on meta copies of the real ones, which are not counted as memory; an op that
    makes a tensor on the model's device (``home``: ``torch.arange(n, device=x.device)``) makes it on meta,
    where it is counted as the real one would be."""

    def __init__(self, home: torch.device) -> None:
        super().__init__()
        self.home = home

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if not leaves and _same_device(kwargs.get("device"), self.home):
            kwargs = {**kwargs, "device": META}
        elif any(t.is_meta for t in leaves):
            if not all(t.is_meta for t in leaves):
                args, kwargs = tree_map(lambda v: to_meta(v, keep_grad=False), (args, kwargs))
            args, kwargs = tree_map(lambda v: META if isinstance(v, torch.device) else v, (args, kwargs))
        return func(*args, **kwargs)


def _same_device(device: Any, home: torch.device) -> bool:
    """Whether ``device`` (as a factory op's ``device=`` gives it) is ``home``; False for None."""
    if device is None or home.type == "meta":
        return False
    device = torch.device(device)
    return device.type == home.type and (device.index is None or home.index is None or device.index == home.index)


class MovesStayOnMeta(TorchFunctionMode):
    """A move of a meta tensor to a real device (``x.to(hidden.device)``, the graph's ``aten.to``) stays on
    meta: a move that changes nothing returns the tensor itself, as it does on the real device, instead of a
    meta copy that the real step never makes."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            if func is torch.Tensor.to:
                device, dtype, non_blocking, memory_format = parse_to(*args[1:], **kwargs)
                if device is not None and device.type != "meta":
                    return args[0].to(device=META, dtype=dtype, non_blocking=non_blocking,
                                      copy=bool(kwargs.get("copy", False)),
                                      memory_format=memory_format or torch.preserve_format)
            elif getattr(func, "overloadpacket", None) is torch.ops.aten.to:
                args, kwargs = tree_map(lambda v: META if isinstance(v, torch.device) else v, (args, kwargs))
        return func(*args, **kwargs)


_SDPA = (F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default)
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class FlashAttention(TorchFunctionMode):
    """Scaled dot-product attention on meta tensors as the fused (flash) kernel a CPU or GPU runs.

    On meta tensors SDPA would take its math path, which materialises and saves the whole attention
    matrix; CPUs and GPUs run a fused kernel that keeps only the output and the log-sum-exp for
    backward. Without dropout (the fused CPU kernel's condition) it is replaced by that kernel,
    ``aten._scaled_dot_product_flash_attention_for_cpu``, which has meta and backward kernels. A boolean
    mask (a padded batch's) is first made an additive mask of the query's dtype, as SDPA does on every
    device: a copy per call, which the kernel keeps for backward.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SDPA:
            bound = dict(zip(_SDPA_ARGS, args)) | kwargs
            query = bound["query"]
            if isinstance(query, torch.Tensor) and query.is_meta and not bound.get("dropout_p"):
                mask = bound.get("attn_mask")
                if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:  # as SDPA does first, on any
                    mask = torch.zeros_like(mask, dtype=query.dtype).masked_fill_(~mask, -math.inf)  # device
                return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    query, bound["key"], bound["value"], 0.0, bool(bound.get("is_causal", False)),
                    attn_mask=mask, scale=bound.get("scale"))[0]
        return func(*args, **kwargs)
