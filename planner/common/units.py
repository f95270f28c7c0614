"""Byte counts as people read them (``1.50 MiB``), for messages and reports; imports nothing of ckplan,
so every module, the exceptions included, can use it."""

from __future__ import annotations


def format_bytes(nbytes: int | float) -> str:
    """Human-readable binary size, e.g. ``'1.50 MiB'``."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
