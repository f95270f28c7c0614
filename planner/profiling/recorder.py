"""The instrumented step of the memory pass: every node's storages, saved tensors, mutations and live-byte peaks,
counted at the dispatcher (``LiveStorages``), and what the allocator adds to them (``Hidden``). ``memory_pass.profile``
runs it on the device; ``meta.memory_on_meta`` replays it on meta tensors.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from planner.capture.api import target_text
from planner.capture.calls import SCOPE_KEY
from planner.capture.inputs import Inputs
from planner.capture.ops import draws_random, kernel_name, writes_new_memory
from planner.capture.step import LossFn, sync
from planner.compat.torch_private import disable_current_modes, tree_leaves
from planner.profiling.allocator import AllocatorTrace, uncounted
from planner.profiling.memtrack import GradBytes, LiveStorages, local_of, storage_key
from planner.profiling.record import LOSS_NODE, StorageCost
from planner.profiling.runner import StepRunner
from planner.profiling.windows import AllocatorWindows


@dataclass(frozen=True, kw_only=True, slots=True)
class Hidden:
    """What a step's nodes allocated inside their ops, where only the allocator sees it (bytes)."""

    forward: list[int]
    """Per node: its forward's allocator peak beyond its live-storage peak (``NodeCost.fwd_hidden_bytes``)."""
    backward: list[int]
    """Per node: the same for its backward (0 without one)."""
    backward_start: list[int]
    """Per node: what the allocator held beyond the live storages when its backward started
    (``NodeCost.bwd_start_hidden_bytes``)."""
    peak_bytes: int
    """The step's highest allocator peak, in live bytes (the storages alive plus what the op allocated inside)."""


_BATCH_NORMS = (torch.ops.aten.native_batch_norm.default, torch.ops.aten._native_batch_norm_legit.default)
"""Ops that update running statistics (args 3 and 4) when training (arg 5) without saying so in their schema."""


class MemoryRecorder(StepRunner):
    """One instrumented step: storages, saved tensors, mutations and per-node peaks."""

    follows_loss = True

    def __init__(self, gm: fx.GraphModule, model: nn.Module, device: torch.device,
                 op_ms: Callable[[Any, tuple, Any], float] | None = None, *, keep_output: bool = True,
                 op_workspace: Callable[[Any, tuple, Any], int] | None = None) -> None:
        super().__init__(gm, device, keep_output=keep_output)
        self.model = model
        self.op_ms = op_ms
        """Optional ``(func, args, out) -> ms`` estimate of each op (the roofline on meta tensors)."""
        self.op_workspace = op_workspace
        """Optional ``(func, args, out) -> bytes`` estimate of what each op allocates inside itself, which a replay
        on meta tensors cannot see (``planner.profiling.workspace``)."""
        self.est_workspace: tuple[defaultdict[int, int], defaultdict[int, int]] = (defaultdict(int), defaultdict(int))
        """Per node, the largest estimated in-op bytes of an op of its forward, and of its backward."""
        self.est_fwd_ms: defaultdict[int, float] = defaultdict(float)
        self.est_bwd_ms: defaultdict[int, float] = defaultdict(float)
        self.tracker = LiveStorages(device)
        self.allocator = AllocatorTrace(device)
        """The allocator during the step, in one window per ``tracker.mark()``: what ops allocate inside
        themselves, which the tracker (the dispatcher) does not see."""
        self.storages: list[StorageCost] = []
        self.records: list[dict] = []
        self.bwd_start: dict[int, int] = {}
        self.bwd_peak: dict[int, int] = {}
        self.bwd_grads: dict[int, int] = {}
        """Per node: bytes of parameter gradients alive when its backward started."""
        self.expanded: dict[int, int] = {}
        """Per node: the dense size of the largest expanded gradient of the loss's it received
        (``StepRunner.on_loss_gradients``)."""
        self.bwd_windows: defaultdict[int, list[int]] = defaultdict(list)
        """Per node: the allocator's window of each window of its backward."""
        self.end_bytes: int | None = None
        """Live bytes once backward has finished."""
        self.input_bytes = 0
        """Bytes of the step's input tensors, each once: what a loader's batch of their shapes holds."""
        self._grads = GradBytes([p for p in dict.fromkeys(model.parameters()) if p.requires_grad], self._here)
        self._index_of: dict[int, int] = {}
        self._producer = -1
        self._current: dict | None = None
        self._open: int | None = None
        self._buffers = list(model.named_buffers())
        for tensor in list(model.parameters()) + [b for _, b in self._buffers]:
            self.tracker.track(tensor)
        self.param_bytes = self.tracker.live_bytes
        self.tracker.on_new_storage = self._new_storage
        self.tracker.on_write = self._written
        self.tracker.on_op = self._op
        self._param_keys = {storage_key(p) for p in model.parameters()}
        self._cached: set[int] = set()
        self._buffer_of = {storage_key(b): name for name, b in self._buffers}
        self.buffer_bytes = {name: b.untyped_storage().nbytes() for name, b in self._buffers}
        self._writes: set[int] = set()

    def step(self, inputs: Inputs, loss_fn: LossFn) -> None:
        tensors = [v for v in tree_leaves((inputs.args, inputs.kwargs)) if isinstance(v, torch.Tensor)]
        for value in tensors:
            self.tracker.track(value)  # unless counted already (e.g. one sharing a parameter's storage)
        self.input_bytes = sum(local_of(t).numel() * t.element_size() for t in {id(t): t for t in tensors}.values())
        self.tracker.trace = []
        with self.allocator, self.tracker, torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            super().step(inputs, loss_fn)
            self._close_window()

    def _mark(self) -> tuple[int, int]:
        """Opens a window of the tracker and of the allocator: (live bytes now, the allocator's window)."""
        return self.tracker.mark(), self.allocator.mark()

    def hidden(self, plain: AllocatorWindows | None = None) -> Hidden:
        """What each node's ops allocated where the tracker does not look, at its allocator peak, beyond its
        live-storage peak: inside the ops (workspaces), and what stays allocated outside storages. Read from
        ``plain``, the same step run with no dispatch mode (``planner.profiling.windows``), where given: there
        the figures may be negative, where the tracker's mode made autograd allocate more than a plain step
        does; else from this step's own allocator trace (never below the live storages). The allocator's bytes
        are read in live bytes from the step's first mark on (what the CPU allocator freed before that is not
        the step's)."""
        n = len(self.records)
        forward, backward, start = [0] * n, [0] * n, [0] * n
        peak = None
        if plain is not None:
            windows, floor = plain.windows, None
            fwd_window, bwd_windows = plain.forward_window, plain.backward_windows
        else:
            windows, floor = self.allocator.windows, 0
            fwd_window = {i: rec["window"] for i, rec in enumerate(self.records)}
            bwd_windows = self.bwd_windows
        bounded = (lambda v: v) if floor is None else (lambda v: max(floor, v))
        if windows and self.records:
            offset = self.records[0]["fwd_start"] - windows[fwd_window[0]].start_bytes

            def level(window: int) -> int:
                return offset + windows[window].peak_bytes

            for i, rec in enumerate(self.records):
                forward[i] = bounded(level(fwd_window[i]) - rec["fwd_peak"])
            for i, opened in bwd_windows.items():
                backward[i] = bounded(max(level(k) for k in opened) - self.bwd_peak[i])
                start[i] = bounded(offset + windows[opened[0]].start_bytes - self.bwd_start[i])
            if plain is not None:
                peak = offset + plain.allocator.peak_bytes
        for i, nbytes in self.est_workspace[0].items():  # estimated where nothing was measured (meta tensors)
            forward[i] = max(forward[i], nbytes)
        for i, nbytes in self.est_workspace[1].items():
            backward[i] = max(backward[i], nbytes)
        hidden = self.with_hidden(Hidden(forward=forward, backward=backward, backward_start=start, peak_bytes=0))
        return hidden if peak is None else replace(hidden, peak_bytes=peak)

    def with_hidden(self, hidden: Hidden) -> Hidden:
        """``hidden`` (per node, measured here or elsewhere) with the step's peak at the allocator it gives."""
        peak = max([self.tracker.peak_bytes] + [r["fwd_peak"] + h for r, h in zip(self.records, hidden.forward)]
                   + [self.bwd_peak[i] + hidden.backward[i] for i in self.bwd_peak])
        return replace(hidden, peak_bytes=peak)

    def before_backward(self) -> None:
        # A tensor "saved" by an autograd node outside the loss's graph (a side branch such as
        # `if h.abs().mean() > 1`) is freed with that branch: only what is alive now is kept.
        alive = set(self._index_of.values())
        for record in self.records:
            record["saves"] &= alive
        self._grads.start()

    def forward_trace(self) -> list[tuple[str, int]]:
        """The ops of the graph's forward (the loss excluded), with live bytes after each."""
        return self._trace()[: self.records[-1]["ops"][0]]

    def _trace(self) -> list[tuple[str, int]]:
        """The tracker's list of ops, which ``step`` starts."""
        if self.tracker.trace is None:
            raise RuntimeError("no step has run: call step() first")
        return self.tracker.trace

    def _new_storage(self, key: int, tensor: torch.Tensor, output: int | None) -> None:
        index = len(self.storages)
        op = len(self._current["kernels"]) if self._current is not None else None  # the op being dispatched
        self.storages.append(StorageCost(nbytes=tensor.untyped_storage().nbytes(), producer=self._producer, op=op,
                                         output=output if op is not None else None))
        self._index_of[key] = index
        weakref.finalize(tensor.untyped_storage(), self._index_of.pop, key, None)

    def _touchable_buffers(self, node: fx.Node | None, values: list) -> list[tuple[str, torch.Tensor]]:
        """Copies of the buffers a node could modify: those passed to it and those of the module it
        calls. Op schemas do not always say (``native_batch_norm`` updates running stats unannotated)."""
        names = {self._buffer_of[storage_key(v)] for v in values
                 if self._here(v) and storage_key(v) in self._buffer_of}
        if node is not None and node.op == "call_module":
            assert isinstance(node.target, str)  # a call_module node's target is the module's path
            names |= {self._buffer_of[storage_key(b)] for b in self.module.get_submodule(node.target).buffers()
                      if storage_key(b) in self._buffer_of}
        with disable_current_modes(), uncounted():  # profiling's own copies are not the model's memory
            return [(name, self.model.get_buffer(name).detach().clone()) for name in sorted(names)]

    def _here(self, value: Any) -> bool:
        """A tensor on the profiled device (meta tensors count only when that is the meta device)."""
        return (isinstance(value, torch.Tensor) and value.device.type == self.device.type
                and (self.device.type == "meta" or not value.is_meta))

    def _op(self, func, args, kwargs, out) -> None:
        """Notes casts of parameters that autocast keeps in its cache, BatchNorm's running-stat
        updates (unannotated in its schema), random draws, and each op's estimated time when estimating."""
        if func in _BATCH_NORMS and len(args) > 5 and args[5] is True:
            for stat in args[3:5]:
                if isinstance(stat, torch.Tensor):
                    self._written(stat)
        if self._current is not None and writes_new_memory(func):
            self._current["kernels"].append(kernel_name(func))
        if self._current is not None and draws_random(func, args, kwargs):
            self._current["random"] = True
        if self.op_workspace is not None:
            window = (0, len(self.records) - 1) if self._current is not None else (1, self._open)
            if window[1] is not None:
                found = self.est_workspace[window[0]]
                found[window[1]] = max(found[window[1]], self.op_workspace(func, args, out))
        if self.op_ms is not None:
            if self._current is not None:
                self.est_fwd_ms[len(self.records) - 1] += self.op_ms(func, args, out)
            elif self._open is not None:
                self.est_bwd_ms[self._open] += self.op_ms(func, args, out)
        if (func is torch.ops.aten._to_copy.default and isinstance(out, torch.Tensor) and args
                and isinstance(args[0], torch.Tensor) and torch.is_autocast_cache_enabled()
                and storage_key(args[0]) in self._param_keys):
            index = self._index_of.get(storage_key(out))
            if index is not None:
                self._cached.add(index)

    def _written(self, tensor: torch.Tensor) -> None:
        if self._current is not None and self._here(tensor):
            self._writes.add(storage_key(tensor))

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        index = self._index_of.get(storage_key(tensor)) if tensor.device.type == self.device.type else None
        if index is not None and self.records and self._current is not None:
            self._current["saves"].add(index)
        if self._current is not None:  # where a re-run ending at this node stops (parameters count)
            self._current["stop_peak"] = self.tracker.window_peak_bytes
        with disable_current_modes():  # not an op of the step
            return tensor.detach()  # not the tensor: a node saving its own output would hold itself through it

    def _storages(self, values: list) -> set[int]:
        found = set()
        for v in values:
            if self._here(v):
                index = self._index_of.get(storage_key(v))
                if index is not None:
                    found.add(index)
        return found

    def around_node(self, index, node, compute, values):
        scope = node.meta.get(SCOPE_KEY, ()) if node is not None else ()
        record: dict[str, Any] = {
            "name": node.name if node is not None else LOSS_NODE,
            "kind": node.op if node is not None else LOSS_NODE,
            "target": target_text(node) if node is not None else "loss_fn",
            "scope": tuple(scope), "inputs": self._storages(values),
            "outputs": set(), "saves": set(), "mutates": set(), "buffers": [], "kernels": [], "random": False,
        }
        self.records.append(record)
        self._current = record
        self._writes = set()
        touchable = self._touchable_buffers(node, values)
        self._producer = index
        first_new = len(self.storages)
        record["fwd_start"], record["window"] = self._mark()
        first_op = len(self._trace())
        try:
            result = super().around_node(index, node, compute, values)
        finally:
            self._producer = -1
            self._current = None
        sync(self.device)
        record["fwd_peak"] = self.tracker.window_peak_bytes
        record["ops"] = (first_op, len(self._trace()))
        record["outputs"] = set(range(first_new, len(self.storages)))
        record["mutates"] = {self._index_of[k] for k in self._writes if k in self._index_of} - record["outputs"]
        with disable_current_modes():
            changed = {name for name, before in touchable  # meta tensors have no values to compare
                       if not before.is_meta and not torch.equal(self.model.get_buffer(name), before)}
        record["buffers"] = sorted(changed | {self._buffer_of[k] for k in self._writes if k in self._buffer_of})
        if node is None:  # the loss node also "uses" the graph's outputs until it has run
            record["inputs"] |= self._storages(values)
        return result

    def on_backward(self, index, phase):
        # A node's backward window runs from its first autograd node until the next graph node's
        # backward starts, so it includes what autograd does after it (summing the gradients of a
        # tensor read by two branches allocates right then).
        if phase != "pre" or index == self._open:
            return
        self._close_window()
        self._open = index
        live, window = self._mark()
        self.bwd_windows[index].append(window)
        self.bwd_start.setdefault(index, live)
        self.bwd_grads.setdefault(index, self._grad_bytes())

    def on_loss_gradients(self, index, grads):
        most = max(g.numel() * g.element_size() for g in grads)
        self.expanded[index] = max(self.expanded.get(index, 0), most)

    def after_backward(self) -> None:
        self._close_window()
        self._grads.stop()
        self.end_bytes = self.tracker.live_bytes

    def _grad_bytes(self) -> int:
        """Bytes of the parameters' gradients alive now (each storage once)."""
        return self._grads.now()

    def _close_window(self) -> None:
        if self._open is not None:
            sync(self.device)
            self.bwd_peak[self._open] = max(self.bwd_peak.get(self._open, 0), self.tracker.window_peak_bytes)
        self._open = None
