"""What the device's allocator holds during a run: the ruler where memory runs out.

The dispatcher (``LiveStorages``) sees the storages ops return. The allocator also sees what an op allocates and
frees inside itself, below the dispatcher: oneDNN's reorders and scratchpads in a CPU convolution (29 MiB in one
ConvNeXt-T step), cuDNN and cuBLAS workspaces, compiled kernels' buffers. A budget holds where allocations fail, so
profiles and measurements read the allocator too. On CPU: torch.profiler's memory events (every allocation and
free of the CPU allocator; no op events, so what it holds grows with the allocations only), cut into windows by
zero-length user ranges. On CUDA: the caching
allocator's own counters (``memory_allocated``, and ``max_memory_allocated`` reset at each mark).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from planner.compat.torch_private import (
    allocation_profiler_start,
    allocation_profiler_stop,
    profiled_allocations,
    profiler_range_enter,
    profiler_range_exit,
)
from planner.errors import ProfileError

MARK = "ckplan.mark"
"""Prefix of the zero-length profiler ranges that open a window (one name per trace: traces nest)."""
UNCOUNTED = "ckplan.uncounted"
"""Name of the profiler range around allocations that are not the device's memory of the step (``uncounted``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Window:
    """The allocator between one ``AllocatorTrace.mark()`` and the next (or the trace's end), bytes relative to
    what it held when the trace started."""

    start_bytes: int
    """Allocated at the mark."""
    peak_bytes: int
    """The most allocated at any moment of the window."""


class AllocatorTrace:
    """The allocated bytes of one device's allocator during a ``with`` block, in windows opened by ``mark()``.

    After the block: ``windows`` (one per ``mark()``, in order), ``peak_bytes`` and ``end_bytes`` (relative to
    what was allocated when the block began), and ``base_bytes``, what that was where the allocator counts it for
    the device alone (CUDA; None on a CPU, whose allocator serves the whole process). Allocations made inside
    ``uncounted()`` are left out, with their frees. On a device without an allocator to read (meta), every
    figure is 0. Traces nest (a training call measured while it plans a new shape group, which profiles): on a
    CPU the profiler stops when the inner one ends, hands every open trace what it recorded, and starts again.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.windows: list[Window] = []
        self.peak_bytes = 0
        self.end_bytes = 0
        self.base_bytes: int | None = None
        self._mark_name = f"{MARK}.{id(self)}"
        self._marks = 0
        self._live = 0  # CPU: allocated now, relative, as far as the events read so far say
        self._uncounted: set[int] = set()  # CPU: pointers of live uncounted allocations
        self._starts: list[int] = []
        self._peaks: list[int] = []
        self._pending = 0  # CUDA: the open window's peak before an inner trace reset the counters
        self._open: int | None = None  # CUDA: the start of the open window, relative

    def __enter__(self) -> AllocatorTrace:
        # tensors of earlier steps that only the cycle collector frees (autograd graphs, checkpoint frames) would
        # be freed at some moment of this one, where the allocator reads less than the step holds
        gc.collect()
        if self.device.type == "cpu":
            _CPU.begin(self)
        elif self.device.type == "cuda":
            _fold_cuda(self.device)
            torch.cuda.synchronize(self.device)
            self.base_bytes = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            _CUDA.append(self)
        return self

    def mark(self) -> int:
        """Opens a window (closing the one before); returns its index in ``windows``."""
        if self.device.type == "cpu":
            profiler_range_exit(profiler_range_enter(self._mark_name))
        elif self.device.type == "cuda":
            self._close_cuda_window()
            self._open = torch.cuda.memory_allocated(self.device) - self._cuda_base()
            _fold_cuda(self.device, but=self)
            torch.cuda.reset_peak_memory_stats(self.device)
        self._marks += 1
        return self._marks - 1

    def __exit__(self, *exc: Any) -> None:
        if self.device.type == "cpu":
            _CPU.end(self)
            if len(self._starts) != self._marks:
                raise RuntimeError(f"the profiler recorded {len(self._starts)} of {self._marks} marks")
            self.windows = [Window(start_bytes=s, peak_bytes=p) for s, p in zip(self._starts, self._peaks)]
            self.end_bytes = self._live
        elif self.device.type == "cuda":
            self._close_cuda_window()
            self.end_bytes = torch.cuda.memory_allocated(self.device) - self._cuda_base()
            _CUDA.remove(self)
        else:
            self.windows = [Window(start_bytes=0, peak_bytes=0) for _ in range(self._marks)]

    def read(self, events: list[tuple[int, int, int, int, bool, str]]) -> None:
        """Takes in what the CPU allocator did while this trace was open (``profiled_allocations``), in order."""
        for _, _, nbytes, ptr, uncounted, name in events:
            if ptr == -1:
                if name == self._mark_name:
                    self._starts.append(self._live)
                    self._peaks.append(self._live)
                continue
            if nbytes > 0 and uncounted:
                self._uncounted.add(ptr)
                continue
            if nbytes < 0 and ptr in self._uncounted:
                self._uncounted.discard(ptr)
                continue
            self._live += nbytes
            self.peak_bytes = max(self.peak_bytes, self._live)
            if self._peaks:
                self._peaks[-1] = max(self._peaks[-1], self._live)

    def _close_cuda_window(self) -> None:
        torch.cuda.synchronize(self.device)
        peak = max(self._pending, torch.cuda.max_memory_allocated(self.device) - self._cuda_base())
        self._pending = 0
        self.peak_bytes = max(self.peak_bytes, peak)
        if self._open is not None:
            self.windows.append(Window(start_bytes=self._open, peak_bytes=peak))

    def _cuda_base(self) -> int:
        assert self.base_bytes is not None  # set on entering, on CUDA
        return self.base_bytes


class _CpuSession:
    """The one profiler session the open CPU traces share: it starts with the first, and when any trace ends it
    stops, hands what it recorded to every open trace, and starts again for those still open."""

    def __init__(self) -> None:
        self.open: list[AllocatorTrace] = []

    def begin(self, trace: AllocatorTrace) -> None:
        if self.open:
            self._flush()
        if not allocation_profiler_start():
            raise ProfileError("ckplan reads the CPU allocator through torch's profiler, which is running "
                               "already: plan and measure outside torch.profiler.profile")
        self.open.append(trace)

    def end(self, trace: AllocatorTrace) -> None:
        self._flush()
        self.open.remove(trace)
        if self.open and not allocation_profiler_start():
            raise ProfileError("torch's profiler was started inside a ckplan measurement; start it outside")

    def _flush(self) -> None:
        events = profiled_allocations(allocation_profiler_stop(), torch.device("cpu"), region=UNCOUNTED)
        for trace in self.open:
            trace.read(events)


_CPU = _CpuSession()
_CUDA: list[AllocatorTrace] = []
"""The CUDA traces open now, outermost first."""


def _fold_cuda(device: torch.device, but: AllocatorTrace | None = None) -> None:
    """Before the peak counters of ``device`` are reset: every other open trace there keeps its open window's peak
    so far."""
    for trace in _CUDA:
        if trace is not but and trace.device == device and trace.base_bytes is not None:
            torch.cuda.synchronize(device)
            trace._pending = max(trace._pending, torch.cuda.max_memory_allocated(device) - trace.base_bytes)


@contextlib.contextmanager
def uncounted() -> Iterator[None]:
    """While open, what the CPU allocator hands out is not the device's memory of the step, and a running
    ``AllocatorTrace`` leaves it out, with its frees: an offloader's host store when the device is the CPU itself
    (host memory apart from the device's on a GPU), the profiler's own copies."""
    handle = profiler_range_enter(UNCOUNTED)
    try:
        yield
    finally:
        profiler_range_exit(handle)
