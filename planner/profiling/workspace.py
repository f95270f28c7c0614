"""What an ATen op allocates inside itself, estimated from shapes: the in-op bytes a meta replay cannot see.

A profile measured on the device reads them at the allocator (``planner.profiling.allocator``). A replay on meta
tensors, for a device spec, only sees the storages ops return, so a spec's estimate adds these by op kind. Known
here only for CPUs, from what oneDNN (torch's CPU convolutions) and the CPU batch norm were measured to allocate
on a x86 machine (torch 2.13, NCHW float tensors): a convolution reorders its output and weights into blocked
layouts and back (forward: output + weight bytes; backward: the output's gradient, the input's gradient when
asked, and the weights), and batch norm's backward a buffer the size of its input. On a GPU spec the workspaces of
cuDNN and cuBLAS depend on the algorithms chosen at run time: none are estimated (``docs/limits.md``).
"""

from __future__ import annotations

from typing import Any

import torch

aten = torch.ops.aten


def _nbytes(value: Any) -> int:
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def cpu_workspace_bytes(func: Any, args: tuple, out: Any) -> int:
    """Bytes ``func`` allocates inside itself on a CPU, beyond the tensors it returns (0 for ops not listed)."""
    packet = getattr(func, "_overloadpacket", None)
    if packet in (aten.convolution, aten._convolution) and len(args) > 1 and args[0].dim() == 4:
        return _nbytes(out) + _nbytes(args[1])  # its output and its weights, reordered
    if packet is aten.convolution_backward and len(args) > 2 and args[0].dim() == 4:
        grad_out, weight = args[0], args[2]
        mask = args[-1] if isinstance(args[-1], (list, tuple)) else (True, True, True)
        return _nbytes(grad_out) + (_nbytes(args[1]) if mask[0] else 0) + _nbytes(weight)
    if packet is aten.native_batch_norm_backward and args:
        return _nbytes(args[1])  # its input's size
    return 0
