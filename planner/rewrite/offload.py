"""Runs a plan's offloads: kept activations copied to host memory in forward and back before backward needs them.

A planned module with offloads carries an ``Offloader`` on its root: while a training forward runs, a dispatch
mode counts the ops that write fresh memory by name, as the profile recorded them (``NodeCost.kernels``), and
marks the storages of the ops the plan offloads (``OffloadTarget``: an op's name, occurrence and output); a
``saved_tensors_hooks`` pair sees every tensor autograd keeps outside the plan's segments, and every segment
input ``torch.utils.checkpoint`` keeps, so that the first time a marked storage is packed its bytes are copied
to host memory and the device storage is let go (the forward frees it after its last use). In backward the
first unpack of a reload group brings its storages back and issues the next group's reloads, one group ahead;
each saved view is rebuilt over the reloaded bytes. An op output selective checkpointing caches is seen by no
hook: it is copied out as soon as its op has run, its bytes are freed in place (``resize_(0)``) where its segment's
forward ends, and they are put back in place before the segment is re-run (``offloaded_contexts`` wraps the
segment's contexts).

On a GPU copies run on a side stream into pinned host memory (torch's caching host allocator pools it), ordered
by events; a storage leaves the device once its copy is done. On a CPU the host store is the same memory: copies
are synchronous and made outside every dispatch mode and inside ``planner.profiling.allocator.uncounted``, so that
the allocator's ruler (and ``LiveStorages``) count device-resident bytes only (the host copies are the tagged store
they leave out), and the plan's predicted peak can be checked exactly on a machine without a GPU.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from planner.capture.ops import kernel_name, writes_new_memory
from planner.common.contexts import entered
from planner.compat.torch_private import TorchDispatchMode, disable_current_modes, storage_id, tree_leaves
from planner.profiling.allocator import uncounted
from planner.profiling.memtrack import dtensor_class, storage_resized
from planner.rewrite.offload_spec import OffloadSpec, OffloadTarget


class _Saved:
    """What autograd holds for a packed view of an offloaded storage: the shared handle and the view's layout."""

    __slots__ = ("dtype", "handle", "offset", "size", "stride")

    def __init__(self, handle: _Handle, tensor: torch.Tensor) -> None:
        self.handle = handle
        self.dtype, self.size, self.stride, self.offset = (tensor.dtype, tensor.size(), tensor.stride(),
                                                           tensor.storage_offset())


class _Handle:
    """One offloaded storage: its bytes on the host, and on the device until the copy out is done or once its
    reload is issued."""

    def __init__(self, step: _Step, storage: torch.UntypedStorage, group: int) -> None:
        self.step, self.group = step, group
        self.device = storage.device
        self.on_device: torch.Tensor | None = _bytes_of(storage)
        self.host: torch.Tensor | None = None
        self.copied: Any = None
        self.ready: Any = None

    def copy_out(self) -> None:
        source = self.on_device
        assert source is not None
        cuda = self.device.type == "cuda"
        with disable_current_modes(), uncounted():  # the host copy is not device memory: rulers must not count it
            self.host = torch.empty(source.numel(), dtype=torch.uint8, pin_memory=cuda)
            if not cuda:
                self.host.copy_(source)
                self.on_device = None
                return
            produced = torch.cuda.current_stream(self.device).record_event()
            side = self.step.offloader.side_stream(self.device)
            side.wait_event(produced)
            with torch.cuda.stream(side):
                self.host.copy_(source, non_blocking=True)
                self.copied = side.record_event()
        self.step.copying.append(self)

    def poll(self) -> bool:
        """Lets the device storage go once its copy to the host is done; True when it is."""
        if self.copied is not None and self.copied.query():
            self.on_device, self.copied = None, None
        return self.copied is None

    def reload(self) -> None:
        """Brings the bytes back to the device (issued: on a GPU, on the side stream)."""
        if self.on_device is not None:  # never left
            return
        assert self.host is not None
        buffer = torch.empty(self.host.numel(), dtype=torch.uint8, device=self.device)
        self.copy_in(buffer)
        self.on_device = buffer

    def copy_in(self, buffer: torch.Tensor) -> None:
        """Copies the host bytes into ``buffer``: at once on a CPU; on a GPU on the side stream, after what the
        compute stream has issued, ``ready`` recorded when done."""
        assert self.host is not None
        if self.device.type != "cuda":
            buffer.copy_(self.host)
            return
        side = self.step.offloader.side_stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            buffer.copy_(self.host, non_blocking=True)
            self.ready = side.record_event()
        buffer.record_stream(side)

    def view(self, saved: _Saved) -> torch.Tensor:
        self.step.unpacked(self.group)
        if self.on_device is None:
            self.reload()
        if self.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(self.ready)
            self.ready = None
        assert self.on_device is not None
        out = torch.empty(0, dtype=saved.dtype, device=self.device)
        return out.set_(self.on_device.untyped_storage(), saved.offset, saved.size, saved.stride)


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """The storage's bytes as a flat uint8 tensor (holds the storage)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class _CachedHandle(_Handle):
    """An offloaded storage selective checkpointing's cache holds, which no hook sees: copied out when its op has
    run, its device bytes freed in place (``resize_(0)``) where its segment's forward ends, and brought back in
    place before the segment is re-run, so that every tensor over it (the cache's among them) reads them again."""

    def __init__(self, step: _Step, storage: torch.UntypedStorage, group: int) -> None:
        super().__init__(step, storage, group)
        self.storage = weakref.ref(storage)
        self.nbytes = storage.nbytes()

    def copy_out(self) -> None:
        source = self.on_device
        super().copy_out()
        if self.device.type == "cuda" and source is not None:
            source.record_stream(self.step.offloader.side_stream(self.device))  # freed only once copied
        self.on_device = source  # freed where the segment's forward ends

    def poll(self) -> bool:
        if self.copied is not None and self.copied.query():
            self.copied = None
        return self.copied is None

    def free(self) -> None:
        """The segment's forward is over: its bytes leave the device (on a GPU, once the copy is done)."""
        storage = self.storage()
        self.on_device = None
        if storage is not None and storage.nbytes():
            storage.resize_(0)
            storage_resized(storage)

    def reload(self) -> None:
        storage = self.storage()
        if storage is None or storage.nbytes() or self.host is None:  # gone with its graph, or never left
            return
        storage.resize_(self.nbytes)
        storage_resized(storage)
        with disable_current_modes():
            self.copy_in(_bytes_of(storage))

    def wait(self) -> None:
        """The re-run is about to read the bytes: the compute stream waits for their reload."""
        self.reload()
        if self.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(self.ready)
            self.ready = None


class _Segment:
    """The cached offloads of one checkpointed segment's forward, freed where it ends, waited for where it is
    re-run."""

    def __init__(self, step: _Step) -> None:
        self.step = step
        self.handles: list[_CachedHandle] = []

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        offloader = self.step.offloader
        outer, offloader.segment = offloader.segment, self
        try:
            yield
        finally:
            offloader.segment = outer
            for handle in self.handles:
                handle.free()

    @contextlib.contextmanager
    def rerun(self) -> Iterator[None]:
        for group in sorted({h.group for h in self.handles}):
            self.step.unpacked(group)
        for handle in self.handles:
            handle.wait()
        yield


_running = threading.local()


def offloaded_contexts(forward: Any, recompute: Any) -> tuple[Any, Any]:
    """A segment's selective-checkpointing contexts (``context_fn``'s pair, made as its forward starts), with the
    running training step's cached offloads: freed where the forward ends, brought back before the re-run."""
    offloader = getattr(_running, "offloader", None)
    if offloader is None or offloader._step is None or not offloader.cached:
        return forward, recompute
    segment = _Segment(offloader._step)
    return entered(segment.forward(), forward), entered(segment.rerun(), recompute)


class _Step:
    """The offloads of one training forward and its backward."""

    def __init__(self, offloader: Offloader) -> None:
        self.offloader = offloader
        self.groups: dict[int, list[weakref.ref[_Handle]]] = {}
        self.copying: list[_Handle] = []
        self.reached: set[int] = set()

    def add(self, handle: _Handle) -> None:
        self.groups.setdefault(handle.group, []).append(weakref.ref(handle))
        handle.copy_out()
        self.offloader.host_peak_bytes = max(self.offloader.host_peak_bytes, self.offloader.host_bytes)

    def host_bytes(self) -> int:
        """Bytes of this step's copies the host store holds: those autograd or a segment's cache still holds (a
        copy goes when the last saved tensor over it does, in backward)."""
        return sum(h.host.numel() for refs in self.groups.values() for ref in refs
                   if (h := ref()) is not None and h.host is not None)

    def poll(self) -> None:
        if self.copying:
            self.copying = [h for h in self.copying if not h.poll()]

    def unpacked(self, group: int) -> None:
        """The first unpack of ``group``: its reloads, and the next group's, are issued."""
        if group in self.reached:
            return
        self.reached.add(group)
        self.poll()
        for g in (group, group + 1):
            for ref in self.groups.get(g, ()):
                handle = ref()
                if handle is not None:
                    if handle.copied is not None:  # still copying out: wait for it, then let the device copy go
                        handle.copied.synchronize()
                        handle.poll()
                    handle.reload()


class _Marking(TorchDispatchMode):
    """Counts the forward's fresh-memory ops by name and marks the storages of the targeted ones."""

    def __init__(self, offloader: Offloader) -> None:
        super().__init__()
        self.offloader = offloader
        self.seen: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        distributed = dtensor_class()
        if distributed is not None and any(issubclass(t, distributed) for t in types):
            return NotImplemented  # counted as the local ops DTensor runs, as the profile counted them
        out = func(*args, **(kwargs or {}))
        if writes_new_memory(func):
            name = kernel_name(func)
            if name in self.offloader.names:
                occurrence = self.seen[name]
                self.seen[name] += 1
                for target in self.offloader.wanted.get((name, occurrence), ()):
                    self.offloader.mark(out, target)
        return out


class Offloader:
    """The forward hooks of a planned module's root that run its offloads (``OffloadSpec``)."""

    def __init__(self, spec: OffloadSpec | None) -> None:
        self.spec: OffloadSpec | None = None
        self.wanted: dict[tuple[str, int], list[OffloadTarget]] = {}
        self.names: set[str] = set()
        self.cached = False
        self.use(spec)
        self.segment: _Segment | None = None
        """The checkpointed segment whose forward runs now (its cached offloads are freed where it ends)."""
        self.host_peak_bytes = 0
        """Most bytes the host store held at once (the last steps', a pipeline stage's microbatches in flight
        together)."""
        self.missed = 0
        """Targets not found by the last forward (the model ran other ops than the plan's)."""
        self._streams: dict[torch.device, Any] = {}
        self._active: list[tuple[Any, ...]] = []
        self._step: _Step | None = None
        self._steps: weakref.WeakSet[_Step] = weakref.WeakSet()
        """Every forward whose offloads are still held (its handles hold it): more than one in a pipeline stage,
        which runs the forwards of several microbatches before their backwards."""
        self._marked: dict[int, tuple[weakref.ref, OffloadTarget]] = {}
        self._handles: dict[int, tuple[weakref.ref, weakref.ref[_Handle]]] = {}

    def use(self, spec: OffloadSpec | None) -> None:
        """Runs ``spec``'s offloads from the next training forward on (None: none): a plan that follows the batch
        switches them with the call's shape group (``planner.rewrite.switching``)."""
        self.spec = spec
        targets = spec.targets if spec is not None else ()
        self.wanted = {}
        for t in targets:
            self.wanted.setdefault((t.kernel, t.occurrence), []).append(t)
        self.names = {t.kernel for t in targets}
        self.cached = any(t.cached for t in targets)
        self._warned = False

    @property
    def host_bytes(self) -> int:
        """Bytes the host store holds now: the copies of every forward's offloaded storages that autograd or a
        segment's cache still holds (``_Step.host_bytes``)."""
        return sum(step.host_bytes() for step in list(self._steps))

    def poll(self) -> None:
        """Lets go of the device storages whose copies to the host are done, of every forward still held: a
        microbatch in flight (a pipeline stage's) lets its copies go while the next one runs."""
        for step in list(self._steps):
            step.poll()

    def side_stream(self, device: torch.device) -> Any:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def begin(self, module: nn.Module, args: Any, kwargs: Any = None) -> None:
        if not (module.training and torch.is_grad_enabled()) or self._active or not self.wanted:
            return
        self.poll()
        self._step, self._marked, self._handles = _Step(self), {}, {}
        self._steps.add(self._step)
        marking = _Marking(self)
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        marking.__enter__()
        hooks.__enter__()
        self._active.append((marking, hooks))
        _running.offloader = self

    def end(self, module: nn.Module, args: Any, *rest: Any) -> None:
        if not self._active:
            return
        marking, hooks = self._active.pop()
        _running.offloader, self.segment = None, None
        hooks.__exit__(None, None, None)
        marking.__exit__(None, None, None)
        found = sum(1 for (name, k) in self.wanted if marking.seen[name] > k)
        self.missed = len(self.wanted) - found
        if self.missed and not self._warned:
            self._warned = True
            warnings.warn(f"ckplan: {self.missed} of the plan's {len(self.wanted)} offloaded activations were not "
                          "found in this forward (it ran other ops than the profiled step): they stay on the device "
                          "and the step may exceed the predicted peak; plan again for this model and input",
                          stacklevel=2)
        self._marked = {}
        self.poll()

    def mark(self, out: Any, target: OffloadTarget) -> None:
        self.poll()
        leaves = tree_leaves(out)
        if target.output is not None:  # found by position, at any shape
            leaves = leaves[target.output:target.output + 1]
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta":
                storage = leaf.untyped_storage()
                if target.output is None and storage.nbytes() != target.nbytes:
                    continue
                if not target.cached:
                    self._marked[storage_id(storage)] = (weakref.ref(storage), target)
                elif self._step is not None and self.segment is not None:  # copied now, freed where it ends
                    handle = _CachedHandle(self._step, storage, target.group)
                    self._step.add(handle)
                    self.segment.handles.append(handle)  # the re-run context holds it while the graph does
                return

    def _pack(self, tensor: torch.Tensor) -> Any:
        if self._step is None or tensor.device.type == "meta" or type(tensor) is not torch.Tensor:
            return tensor
        storage = tensor.untyped_storage()
        key = storage_id(storage)
        known = self._handles.get(key)
        if known is not None and known[0]() is storage and (handle := known[1]()) is not None:
            return _Saved(handle, tensor)
        marked = self._marked.get(key)
        if marked is None or marked[0]() is not storage:
            return tensor
        del self._marked[key]
        handle = _Handle(self._step, storage, marked[1].group)
        self._step.add(handle)
        self._handles[key] = (weakref.ref(storage), weakref.ref(handle))
        return _Saved(handle, tensor)

    @staticmethod
    def _unpack(saved: Any) -> torch.Tensor:
        return saved.handle.view(saved) if isinstance(saved, _Saved) else saved


def install_offloads(module: nn.Module, spec: OffloadSpec | None, *,
                     switched: bool = False) -> tuple[Offloader, list[Any]] | None:
    """Puts the offloads of ``spec`` on the planned ``module``'s root, with the handles of its hooks (nothing when
    ``spec`` is None or empty, unless ``switched``: a plan that follows the batch switches them with the call's
    group, ``Offloader.use``)."""
    if not switched and (spec is None or not spec.targets):
        return None
    offloader = Offloader(spec)
    handles = [module.register_forward_pre_hook(offloader.begin, with_kwargs=True),
               module.register_forward_hook(offloader.end, always_call=True)]
    module._ckplan_offloader = offloader  # type: ignore[assignment]
    return offloader, handles


def offloader_of(module: nn.Module) -> Offloader | None:
    """The offloads a planned module runs, if any."""
    return getattr(module, "_ckplan_offloader", None)
