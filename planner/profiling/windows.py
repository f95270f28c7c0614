"""The allocator in a plain step, in the windows the memory pass opens: where memory really rises.

The memory pass counts storages at the dispatcher (``LiveStorages``, a Python dispatch mode), and a Python
dispatch mode changes what autograd allocates: every tensor that passed through it holds one more reference, so
autograd's sum of the gradients a tensor gets from two or more readers (a residual stream, an RNN's input sliced
at each step, a weight tied to two layers) never reuses the first gradient's memory and allocates a fresh one
each time (``InputBuffer::accumulate`` reuses it only when it holds the last reference). Under the mode a
64-step LSTM that slices its embedded input at each step peaked 4 MiB (8%) above the same step without it.
So the allocator is read in a step with no mode (the first timed step, ``timing.time_step``): an
``AllocatorTrace`` window opened at each node's forward and at each node's first autograd node in backward,
exactly where the memory pass opens its windows, so the two line up node by node.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from planner.profiling.allocator import AllocatorTrace, Window


class AllocatorWindows:
    """The allocator during one step run node by node (``StepRunner``), one window for every node's forward and
    one for the backward of each node from its first autograd node until the next node's starts, in the order
    the memory pass opens them. The runner calls ``forward`` and ``backward`` where those begin."""

    def __init__(self, device: torch.device) -> None:
        self.allocator = AllocatorTrace(device)
        self.forward_window: dict[int, int] = {}
        """Per node: the window of its forward."""
        self.backward_windows: defaultdict[int, list[int]] = defaultdict(list)
        """Per node: the windows of its backward, in order."""
        self._open: int | None = None

    def forward(self, index: int) -> None:
        """Node ``index``'s forward begins."""
        self.forward_window[index] = self.allocator.mark()

    def backward(self, index: int) -> None:
        """An autograd node of node ``index`` is about to run."""
        if index != self._open:
            self._open = index
            self.backward_windows[index].append(self.allocator.mark())

    @property
    def windows(self) -> list[Window]:
        return self.allocator.windows
