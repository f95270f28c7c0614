"""How many intra-op threads a measured profile runs with: no more than the cores other processes leave free.

On a shared CPU (data-loader workers, another job, a test runner beside the trainer), torch's intra-op threads
wait for each other at every parallel op: with every core taken by other processes, a step run with as many
threads as cores measured 2-4x slower than with one thread, and the per-node times stopped adding up to the
step (``bench/busy.py``). The timed passes of a profile therefore run with the threads the machine has free
(at least one), counted from ``/proc/stat`` just before, and time twice as many steps, each time the fastest
(``planner.profiling.timing``: other processes only ever add time); elsewhere, or where nothing is busy,
torch's own thread count is kept. The caller's thread count is restored afterwards.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

_WINDOW_S = 0.2
"""How long the machine's CPU use is sampled for."""


def _cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs since boot, from ``/proc/stat``; None where there is none."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    if len(fields) < 4:
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle and iowait
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest is counted in user)
    return total - idle, total


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the platform has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def free_cores(window_s: float = _WINDOW_S) -> float | None:
    """Cores of this process's that other processes (and this one's other threads) left idle over the last
    ``window_s`` seconds, while this thread slept; None where the platform does not say."""
    before = _cpu_times()
    if before is None:
        return None
    time.sleep(window_s)
    after = _cpu_times()
    if after is None or after[1] <= before[1]:
        return None
    busy_share = (after[0] - before[0]) / (after[1] - before[1])
    busy = busy_share * (os.cpu_count() or 1)
    return max(0.0, min(float(usable_cores()), (os.cpu_count() or 1) - busy))


def fair_threads(free: float | None, current: int) -> int:
    """The intra-op threads to time with when ``free`` cores are idle: ``current`` where the machine leaves that
    many (or does not say), else the free cores rounded to nearest, at least one."""
    if free is None or free >= current - 0.5:
        return current
    return max(1, math.floor(free + 0.5))


@dataclass(frozen=True, kw_only=True, slots=True)
class TimingThreads:
    """What the timed passes of a profile run with."""

    threads: int
    """Intra-op threads (``torch.set_num_threads``) while they run."""
    busy: bool
    """Whether other processes had taken cores this process may use (the passes then time more steps)."""


@contextmanager
def threads_for_timing(device: torch.device) -> Iterator[TimingThreads]:
    """Runs the block with the intra-op threads the machine has free (``fair_threads``), restoring the caller's
    count after. Only CPU steps are affected (a GPU's kernels do not use them; its steps are not timed busy)."""
    current = torch.get_num_threads()
    free = free_cores() if device.type == "cpu" else None
    use = fair_threads(free, current)
    if use != current:
        torch.set_num_threads(use)
    try:
        yield TimingThreads(threads=use, busy=free is not None and free < usable_cores() - 0.5)
    finally:
        if use != current:
            torch.set_num_threads(current)
