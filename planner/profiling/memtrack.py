"""Counts live tensor storages on a device, exactly, as ops allocate and free them.

Shared by the profile stage (per-node peaks) and the measure stage (the peak of a
whole step), so that predictions and measurements use the same ruler. Storages
are counted once however many views point at them; a storage is released when
torch frees it (storage Python objects live exactly as long as the storage).
"""

from __future__ import annotations

import functools
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from planner.compat.torch_private import TorchDispatchMode, storage_id, tree_leaves
from planner.errors import ProfileError

_RUNNING: list[LiveStorages] = []
"""The trackers entered and not yet left, outermost first."""


class OverLimit(ProfileError):
    """A tracked step went over ``LiveStorages.limit_bytes``: it does not fit whole where it runs."""


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``tensor``: a DTensor's local shard (tensor parallelism), an asynchronous
    collective's result; the tensor itself otherwise. A DTensor's own storage is a dataless stand-in sized for
    the global tensor, which no rank holds."""
    while True:
        inner = getattr(tensor, "_local_tensor", None)
        if inner is None:
            inner = getattr(tensor, "elem", None) if type(tensor).__name__ == "AsyncCollectiveTensor" else None
        if not isinstance(inner, torch.Tensor):
            return tensor
        tensor = inner


def storage_key(tensor: torch.Tensor) -> int:
    """Identity of the storage behind ``tensor`` (its local shard's for a DTensor; valid while it is alive)."""
    return storage_id(local_of(tensor).untyped_storage())


@functools.cache
def dtensor_class() -> Any:
    """torch's DTensor class (None for a torch built without distributed), imported once, when first needed."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return None
    return DTensor


def storage_resized(storage: torch.UntypedStorage) -> None:
    """Tells every running ``LiveStorages`` that ``storage`` was resized in place (the offload executor frees
    a cached activation's bytes so, and brings them back so)."""
    for tracker in _RUNNING:
        tracker.resized(storage)


class LiveStorages(TorchDispatchMode):
    """A dispatch mode that tracks the bytes of live storages on one device.

    Attributes:
        live_bytes: bytes of storages currently alive.
        peak_bytes: highest ``live_bytes`` seen since creation.
        window_peak_bytes: highest ``live_bytes`` since the last ``mark()``.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.device = torch.device(device)
        self.live_bytes = 0
        self.peak_bytes = 0
        self.window_peak_bytes = 0
        self._sizes: dict[int, int] = {}
        self.on_new_storage: Callable[[int, torch.Tensor, int | None], None] | None = None
        """Optional callback ``(key, tensor, output)`` run for each newly seen storage; ``output``: which of the
        op's outputs it is (its index among ``tree_leaves`` of what the op returned), None when not made by an
        op (tracked by hand)."""
        self.on_write: Callable[[torch.Tensor], None] | None = None
        """Optional callback ``(tensor)`` run for each tensor an op modifies in place."""
        self.trace: list[tuple[str, int]] | None = None
        """When a list, ``(op name, live bytes after it)`` is appended for every op."""
        self.on_op: Callable[[Any, tuple, dict, Any], None] | None = None
        """Optional callback ``(func, args, kwargs, out)`` run after every op."""
        self.events: list[tuple[int, int]] | None = None
        """When a list, ``(key, bytes)`` is appended for each storage counted and ``(key, 0)`` when it is freed: the
        step's allocation sequence as the dispatcher sees it (``planner.memory.caching`` replays it)."""
        self.limit_bytes: int | None = None
        """When set, an op that leaves more than this many bytes live raises ``OverLimit`` (before the next
        op can allocate more): the profiler's guard on a device too small for the whole step."""

    def track(self, tensor: torch.Tensor, output: int | None = None) -> bool:
        """Start counting the storage behind ``tensor`` (a DTensor's local shard); False if already counted, or if
        it is not on the device (a fake tensor says it is, but its storage is on meta: a plan made during a call
        traces one). ``output``: which output of the op being dispatched it is (``on_new_storage``)."""
        tensor = local_of(tensor)
        if tensor.device.type != self.device.type or (tensor.is_meta and self.device.type != "meta"):
            return False
        storage = tensor.untyped_storage()
        if storage.device.type != self.device.type:
            return False
        key = storage_id(storage)
        if key in self._sizes:
            return False
        nbytes = storage.nbytes()
        self._sizes[key] = nbytes
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self.window_peak_bytes = max(self.window_peak_bytes, self.live_bytes)
        weakref.finalize(storage, self._release, key)
        if self.events is not None:
            self.events.append((key, nbytes))
        if self.on_new_storage is not None:
            self.on_new_storage(key, tensor, output)
        return True

    def __enter__(self) -> LiveStorages:
        _RUNNING.append(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        _RUNNING.remove(self)

    def resized(self, storage: torch.UntypedStorage) -> None:
        """Counts a counted storage at its size now (``resize_`` is no op a dispatch mode sees)."""
        key = storage_id(storage)
        if key in self._sizes:
            nbytes = storage.nbytes()
            self.live_bytes += nbytes - self._sizes[key]
            self._sizes[key] = nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            self.window_peak_bytes = max(self.window_peak_bytes, self.live_bytes)

    def mark(self) -> int:
        """Start a new peak window; returns the live bytes now."""
        self.window_peak_bytes = self.live_bytes
        return self.live_bytes

    def _release(self, key: int) -> None:
        nbytes = self._sizes.pop(key, None)
        if nbytes is not None:
            self.live_bytes -= nbytes
            if self.events is not None:
                self.events.append((key, 0))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        distributed = dtensor_class()
        if distributed is not None and any(issubclass(t, distributed) for t in types):
            # tensor parallelism: let DTensor run the op, so that this mode sees the local ops it runs, the
            # collectives its sharding propagation issues and their buffers (as torch's CommDebugMode does)
            return NotImplemented
        kwargs = kwargs or {}
        if self.on_write is not None:
            for tensor in written_tensors(func, args, kwargs):
                self.on_write(tensor)
        out = func(*args, **kwargs)
        for i, leaf in enumerate(tree_leaves(out)):
            if isinstance(leaf, torch.Tensor):
                self.track(leaf, i)
        if self.limit_bytes is not None and self.live_bytes > self.limit_bytes:
            raise OverLimit(f"the step holds {self.live_bytes} B after {func.name()}, over the "
                            f"{self.limit_bytes} B this process can allocate on {self.device}")
        if self.trace is not None:
            self.trace.append((func.name(), self.live_bytes))
        if self.on_op is not None:
            self.on_op(func, args, kwargs, out)
        return out


def written_tensors(func, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """Tensors an aten op modifies in place, read from its schema (``Tensor(a!)`` arguments)."""
    written: list[torch.Tensor] = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            written.extend(t for t in tree_leaves(value) if isinstance(t, torch.Tensor))
    return written


class GradBytes:
    """Bytes of the parameters' gradients alive during one backward, each storage once, asked at every node's
    backward: kept up to date by the parameters' post-accumulate-grad hooks (a scan of every parameter per node
    is quadratic: 76 s on a chain of 1,000 blocks), or by that scan where the parameters are DTensors (FSDP2
    sets their gradients after its reduce-scatter, which no such hook sees)."""

    def __init__(self, params: list[torch.Tensor], here: Callable[[Any], bool]) -> None:
        self.params = params
        self.here = here
        self.hooked = not any(isinstance(p, dtensor_class() or ()) for p in params)
        self._key: dict[int, int] = {}  # id(parameter) -> its gradient's storage
        self._bytes: Counter[int] = Counter()  # storage -> bytes, while some parameter's gradient is it
        self._holders: Counter[int] = Counter()
        self._total = 0
        self._handles: list = []

    def start(self) -> None:
        """Backward begins: the gradients alive now (accumulated ones), then the hooks."""
        self._key.clear()
        self._bytes.clear()
        self._holders.clear()
        self._total = 0
        for p in self.params:
            self._note(p)
        if self.hooked:
            self._handles = [p.register_post_accumulate_grad_hook(self._note) for p in self.params]

    def stop(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def now(self) -> int:
        if not self.hooked:
            self.start()
        return self._total

    def _note(self, param: torch.Tensor) -> None:
        grad = param.grad
        key = storage_key(grad) if grad is not None and self.here(local_of(grad)) else None
        old = self._key.pop(id(param), None)
        if old is not None:
            self._holders[old] -= 1
            if not self._holders[old]:
                self._total -= self._bytes.pop(old)
        if grad is not None and key is not None:
            self._key[id(param)] = key
            if not self._holders[key]:
                self._bytes[key] = local_of(grad).untyped_storage().nbytes()
                self._total += self._bytes[key]
            self._holders[key] += 1
