"""The host link's copy rates, measured on the device a step is profiled on (``Profile.d2h_gb_per_s``)."""

from __future__ import annotations

import time

import torch

from planner.compat.torch_private import disable_current_modes

PROBE_BYTES = {"cuda": 256 * 2**20, "cpu": 32 * 2**20}
"""Bytes each probe copy moves: enough to reach the link's rate, little next to a training step."""


def measure_host_link(device: torch.device, repeats: int = 3) -> tuple[float, float] | None:
    """``(device_to_host, host_to_device)`` GB/s of copies between ``device`` and pinned host memory (plain host
    memory on a CPU, where a copy is a memcpy), the fastest of ``repeats``; None on a device it cannot probe."""
    if device.type not in PROBE_BYTES:
        return None
    nbytes = PROBE_BYTES[device.type]
    with disable_current_modes():  # probes are not part of the step any tracker counts
        source = torch.empty(nbytes, dtype=torch.uint8, device=device)
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
        back = torch.empty_like(source)
        d2h = min(_timed(lambda: host.copy_(source, non_blocking=True), device) for _ in range(repeats))
        h2d = min(_timed(lambda: back.copy_(host, non_blocking=True), device) for _ in range(repeats))
    return nbytes / d2h / 1e9, nbytes / h2d / 1e9


def _timed(copy, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    began = time.perf_counter()
    copy()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return max(time.perf_counter() - began, 1e-9)
