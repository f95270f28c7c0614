"""One plain step at the allocator, in the windows the memory pass opens: where memory really rises.

The memory pass counts storages at the dispatcher (``LiveStorages``, a Python dispatch mode), and a Python
dispatch mode changes what autograd allocates: every tensor that passed through it holds one more reference, so
autograd's sum of the gradients a tensor gets from two or more readers (a residual stream, an RNN's input sliced
at each step, a weight tied to two layers) never reuses the first gradient's memory and allocates a fresh one
each time (``InputBuffer::accumulate`` reuses it only when it holds the last reference). Under the mode a
512-step LSTM that slices its embedded input at each step peaked 4 MiB (8%) above the same step without it.
So the allocator is read in a step of its own, with no mode: the same graph run node by node (``StepRunner``),
an ``AllocatorTrace`` window opened at each node's forward and at each node's first autograd node in backward,
exactly where the memory pass opens its windows, so the two line up one to one.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.fx as fx

from planner.profiling.allocator import AllocatorTrace, Window
from planner.profiling.runner import StepRunner


class AllocatorWindows(StepRunner):
    """A step whose every node's forward, and the backward of each node from its first autograd node until the
    next node's starts, is a window of an ``AllocatorTrace`` (the memory pass's windows, in its order)."""

    def __init__(self, gm: fx.GraphModule, device: torch.device, *, keep_output: bool = True) -> None:
        super().__init__(gm, device, keep_output=keep_output)
        self.allocator = AllocatorTrace(device)
        self.forward_window: dict[int, int] = {}
        """Per node: the window of its forward."""
        self.backward_windows: defaultdict[int, list[int]] = defaultdict(list)
        """Per node: the windows of its backward, in order."""
        self._open: int | None = None

    def step(self, inputs, loss_fn) -> None:
        with self.allocator:
            super().step(inputs, loss_fn)

    def around_node(self, index, node, compute, values):
        self.forward_window[index] = self.allocator.mark()
        return super().around_node(index, node, compute, values)

    def on_backward(self, index: int, phase: str) -> None:
        if phase == "pre" and index != self._open:
            self._open = index
            self.backward_windows[index].append(self.allocator.mark())

    @property
    def windows(self) -> list[Window]:
        return self.allocator.windows
