"""How many more bytes this process may allocate on a device: what decides whether a training step can be
profiled whole, or must be profiled in pieces (``planner.profiling.api.profile_for``).

On a GPU: the free device memory plus what torch's caching allocator holds unused, within the share
``torch.cuda.set_per_process_memory_fraction`` allows. On the CPU: the least of what the address-space
limit leaves (``RLIMIT_AS``, as ``ulimit -v`` or a container sets it), what the cgroup's memory limit
leaves, and the memory the kernel reports available. None when nothing limits it (another device type).

``capacity_bytes`` says what a device can hold for one training step: what ``budget="device"`` means.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

import torch

from planner.errors import BudgetError

_CGROUP = Path("/sys/fs/cgroup")


def headroom_bytes(device: torch.device) -> int | None:
    """Bytes this process can still allocate on ``device``; None when it cannot be told."""
    if device.type == "cuda":
        return _cuda_headroom(device)
    if device.type == "cpu":
        limits = [v for v in (_address_space_left(), _cgroup_left(), _meminfo("MemAvailable")) if v is not None]
        return min(limits) if limits else None
    return None


RESERVE_SHARE = 0.1
"""Share of a device's memory a ``"device"`` budget leaves to what plans do not count: the CUDA caching allocator's
reserve beyond what it allocates (rounded blocks, split segments), libraries' workspaces allocated once (cuBLAS,
cuDNN), the CPU heap's fragmentation."""
CUDA_CONTEXT_BYTES = 512 * 2**20
"""What a GPU spec's device loses to the CUDA context and the kernels' images before any tensor (measured: about
500 MiB on an H100 with torch's kernels loaded)."""


def capacity_bytes(device: torch.device, *, held_bytes: int) -> int:
    """What ``device`` can hold for one training step of this process: what it can still allocate
    (``headroom_bytes``) plus ``held_bytes``, what the step's own tensors hold already (parameters, buffers,
    inputs), less ``RESERVE_SHARE``.

    Raises:
        BudgetError: how much ``device`` can hold cannot be told."""
    room = headroom_bytes(device) if device.type in ("cuda", "cpu") else None
    if room is None:
        raise BudgetError(f"how much memory {device} has cannot be told here, so a 'device' budget means nothing; "
                          "give the budget in bytes ('40GB') or plan for a device spec (device='h100')")
    if device.type == "cuda":
        held_bytes = torch.cuda.memory_allocated(device)  # everything this process's tensors hold there
    return int((room + held_bytes) * (1 - RESERVE_SHARE))


def spec_capacity_bytes(memory_bytes: int, *, gpu: bool) -> int:
    """What a device spec of ``memory_bytes`` can hold for one training step: its memory less the CUDA context on
    a GPU, less ``RESERVE_SHARE``."""
    return int((memory_bytes - (CUDA_CONTEXT_BYTES if gpu else 0)) * (1 - RESERVE_SHARE))


ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
"""The environment variable the CUDA caching allocator reads its settings from when the process starts."""


def expandable_segments() -> bool:
    """Whether this process's ``ALLOC_CONF`` turns on the caching allocator's expandable segments."""
    return "expandable_segments:true" in os.environ.get(ALLOC_CONF, "").replace(" ", "").lower()


def is_gpu(device: str) -> bool:
    """Whether a plan's ``device`` (where it was made, ``cuda:0``, or a spec's name) is a GPU, whose caching
    allocator reserves more than it allocates."""
    if device.startswith("cuda"):
        return True
    from planner.profiling.devices import is_device_spec, load_device

    return is_device_spec(device) and load_device(device).kind == "gpu"


def reserve_note(device: str) -> str | None:
    """What a budget on a GPU bounds, and the allocator setting that bears on it, in one line: plans count what the
    CUDA caching allocator allocates (``torch.cuda.max_memory_allocated``); it reserves more (whole blocks and
    segments), and reserved memory is what runs out. With ``expandable_segments:True`` in ``ALLOC_CONF`` (read
    from this process's environment) the reserve stays near what is allocated; without it, the note says to set
    it. None for a device that is not a GPU (``device``: where a plan was made, ``cuda:0``, or a spec's name)."""
    if not is_gpu(device):
        return None
    expandable = expandable_segments()
    bounded = ("the budget bounds what the CUDA caching allocator allocates (max_memory_allocated); it reserves "
               "more, and reserved memory is what runs out")
    if expandable:
        return f"{bounded}: {ALLOC_CONF} has expandable_segments:True, which keeps the reserve near it"
    return (f"{bounded}: set {ALLOC_CONF}=expandable_segments:True where the step trains to keep the reserve near it, "
            "or leave room (budget=\"90% of device\")")


def hard_limit(device: torch.device) -> bool:
    """Whether going past ``headroom_bytes`` makes an allocation fail (a GPU, ``RLIMIT_AS``, a cgroup limit),
    rather than the kernel reclaiming memory from other processes first (the CPU's available memory)."""
    if device.type == "cuda":
        return True
    return device.type == "cpu" and (_address_space_left() is not None or _cgroup_left() is not None)


def _cuda_headroom(device: torch.device) -> int:
    free, total = torch.cuda.mem_get_info(device)
    reserved, allocated = torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device)
    cached = reserved - allocated  # held by torch's allocator, free for our tensors
    allowed = int(torch.cuda.get_per_process_memory_fraction(device) * total) - allocated
    return max(0, min(free + cached, allowed))


def _address_space_left() -> int | None:
    """What ``RLIMIT_AS`` leaves: the soft limit minus the address space mapped now (``VmSize``)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    mapped = _status("VmSize")
    return None if mapped is None else max(0, soft - mapped)


def _cgroup_left() -> int | None:
    """What the cgroup (v2) memory limit leaves: ``memory.max`` minus ``memory.current``."""
    try:
        limit = (_CGROUP / "memory.max").read_text().strip()
        current = int((_CGROUP / "memory.current").read_text().strip())
    except (OSError, ValueError):
        return None
    return None if limit == "max" else max(0, int(limit) - current)


def host_memory_bytes() -> int | None:
    """This machine's physical memory (``MemTotal``), bytes; None where the system does not say."""
    return _meminfo("MemTotal")


def _status(key: str) -> int | None:
    """A ``kB`` line of ``/proc/self/status``, in bytes."""
    return _kilobytes(Path("/proc/self/status"), key)


def _meminfo(key: str) -> int | None:
    """A ``kB`` line of ``/proc/meminfo``, in bytes."""
    return _kilobytes(Path("/proc/meminfo"), key)


def _kilobytes(path: Path, key: str) -> int | None:
    try:
        for line in path.read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
