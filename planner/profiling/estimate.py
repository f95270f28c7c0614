"""Roofline time of one ATen op on a device that is not here: FLOPs and bytes against peak rates.

An op takes ``op_overhead + max(FLOPs / peak FLOP/s, bytes / bandwidth)``. FLOPs come from
``torch.utils.flop_counter`` (the formulas ``FlopCounterMode`` uses: matmuls, convolutions,
attention; everything else is memory-bound and counts 0 FLOPs). Bytes are the sizes of the
op's tensor inputs and outputs; views move nothing and cost only the overhead. Works on meta
tensors: only shapes and dtypes are read.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import flop_counter

from planner.compat.torch_private import tree_leaves
from planner.profiling.devices import DeviceSpec

aten = torch.ops.aten
_FREE = {aten.empty.memory_format, aten.empty_like.default, aten.empty_strided.default,
         aten.new_empty.default, aten.new_empty_strided.default}
"""Allocations that touch no memory (their cost is the op overhead)."""
_CPU_FLASH = aten._scaled_dot_product_flash_attention_for_cpu
_CPU_FLASH_BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward
_PRECISION = {torch.float64: "float64", torch.float32: "float32", torch.bfloat16: "bfloat16",
              torch.float16: "float16", torch.float8_e4m3fn: "float8", torch.float8_e5m2: "float8"}


def _gqa(query: torch.Tensor, kv: torch.Tensor) -> list[int]:
    """Shape of ``kv`` with as many heads as ``query`` (grouped-query attention counts every head)."""
    return [*kv.shape[:-3], query.shape[-3], *kv.shape[-2:]]


def op_flops(func: Any, args: tuple, out: Any) -> int:
    """FLOPs of one ATen op, by ``torch.utils.flop_counter``'s formulas (0 for ops it does not count)."""
    packet = getattr(func, "_overloadpacket", None)
    if packet is _CPU_FLASH:  # what SDPA runs on CPU and meta; same formula as the CUDA kernels
        q, k, v = args[:3]
        return flop_counter.sdpa_flop_count(list(q.shape), _gqa(q, k), _gqa(q, v))
    if packet is _CPU_FLASH_BWD:
        grad_out, q, k, v = args[:4]
        return flop_counter.sdpa_backward_flop_count(list(grad_out.shape), list(q.shape), _gqa(q, k), _gqa(q, v))
    formula = flop_counter.flop_registry.get(packet)
    if formula is None:
        return 0
    return int(formula(*args, out_val=out))


def op_bytes(func: Any, args: tuple, out: Any) -> int:
    """Bytes an op reads and writes: its tensor inputs and outputs (0 for views and bare allocations)."""
    if func in _FREE or _is_view(func):
        return 0
    tensors = [t for t in tree_leaves((args, out)) if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def _is_view(func: Any) -> bool:
    returns = getattr(getattr(func, "_schema", None), "returns", ())
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def _precision(args: tuple) -> str:
    for t in tree_leaves(args):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            name = _PRECISION.get(t.dtype, "float32")
            if name == "float32" and torch.get_float32_matmul_precision() != "highest":
                return "tf32"  # torch.set_float32_matmul_precision("high") lets matmuls use TF32
            return name
    return "float32"


class Roofline:
    """Estimated milliseconds of ATen ops on one device (``Roofline(spec).op_ms(func, args, out)``)."""

    def __init__(self, spec: DeviceSpec) -> None:
        self.spec = spec

    def op_ms(self, func: Any, args: tuple, out: Any) -> float:
        """``op_overhead + max(FLOPs / peak rate at the op's precision, bytes / bandwidth)``, in ms."""
        flops = op_flops(func, args, out)
        compute_s = flops / self.spec.flops_per_s(_precision(args)) if flops else 0.0
        memory_s = op_bytes(func, args, out) / self.spec.bytes_per_s
        return self.spec.op_overhead_us / 1e3 + max(compute_s, memory_s) * 1e3
