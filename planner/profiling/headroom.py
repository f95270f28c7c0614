"""How many more bytes this process may allocate on a device: what decides whether a training step can be
profiled whole, or must be profiled in pieces (``planner.profiling.api.profile_for``).

On a GPU: the free device memory plus what torch's caching allocator holds unused, within the share
``torch.cuda.set_per_process_memory_fraction`` allows. On the CPU: the least of what the address-space
limit leaves (``RLIMIT_AS``, as ``ulimit -v`` or a container sets it), what the cgroup's memory limit
leaves, and the memory the kernel reports available. None when nothing limits it (another device type).
"""

from __future__ import annotations

import resource
from pathlib import Path

import torch

_CGROUP = Path("/sys/fs/cgroup")


def headroom_bytes(device: torch.device) -> int | None:
    """Bytes this process can still allocate on ``device``; None when it cannot be told."""
    if device.type == "cuda":
        return _cuda_headroom(device)
    if device.type == "cpu":
        limits = [v for v in (_address_space_left(), _cgroup_left(), _meminfo("MemAvailable")) if v is not None]
        return min(limits) if limits else None
    return None


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
