"""Parses the user's memory budget, once, into bytes.

Accepted forms: an int (bytes), ``"4GB"``/``"512MB"``/``"64KB"`` (powers of 10),
``"4GiB"``/``"512MiB"``/``"64KiB"`` (powers of 2), ``"123B"``, ``"60%"`` (of the un-checkpointed
predicted peak), ``"device"`` (what the device the plan is for can hold for the step,
``planner.planning.prepared.device_bytes``) and ``"90% of device"``.
"""

from __future__ import annotations

import enum
import re
import reprlib
from fractions import Fraction

from planner.common.units import format_bytes  # noqa: F401 - re-exported: budgets and byte counts go together
from planner.errors import BudgetError

ACCEPTED_FORMS = ("an int of bytes, '4GB', '4GiB', '512MB', '512MiB', '64KB', '64KiB', '1000B', '60%', 'device' or "
                  "'90% of device'")

class BudgetBounds(enum.Enum):
    """What a budget on a GPU bounds: what the CUDA caching allocator reserves (what runs out, the default) or what
    it allocates (``torch.cuda.max_memory_allocated``). On a CPU both are what is allocated."""

    RESERVED = "reserved"
    ALLOCATED = "allocated"


_UNITS = {
    "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}
MAX_BUDGET_BYTES = 2**63 - 1
"""The largest budget: an int64, as the solver holds it (far above any device's memory)."""
_PATTERN = re.compile(r"^\s*([0-9]{1,100}(?:\.[0-9]{1,100})?)\s*([A-Za-z]+|%)\s*$")
"""A decimal number (read exactly, as a fraction: ``"4.35GB"`` is 4_350_000_000 bytes) and a unit."""
_DEVICE = re.compile(r"^\s*(?:([0-9]{1,100}(?:\.[0-9]{1,100})?)\s*%\s+of\s+)?device\s*$", re.IGNORECASE)
"""``device`` or ``N% of device``."""


def parse_budget(budget: int | str, *, baseline_peak_bytes: int | None = None,
                 device_bytes: int | None = None) -> int:
    """Converts a budget to bytes.

    Args:
        budget: int bytes or a string in one of ``ACCEPTED_FORMS``.
        baseline_peak_bytes: the un-checkpointed peak, needed for ``"NN%"`` budgets.
        device_bytes: what the device can hold for the step, needed for ``"device"`` budgets.

    Returns:
        The budget in bytes.

    Raises:
        BudgetError (a ValueError): the budget is malformed, non-positive, above ``MAX_BUDGET_BYTES`` or a
            percentage over 100, or a percentage without ``baseline_peak_bytes``, or ``device`` without
            ``device_bytes``.

    >>> parse_budget("4GB"), parse_budget("1KiB"), parse_budget("50%", baseline_peak_bytes=300)
    (4000000000, 1024, 150)
    >>> parse_budget("device", device_bytes=1000), parse_budget("90% of device", device_bytes=1000)
    (1000, 900)
    """
    nbytes, percent, of_device = _read(budget)
    if percent is None:
        return nbytes
    whole = device_bytes if of_device else baseline_peak_bytes
    if whole is None:
        raise BudgetError(f"budget {budget!r} is relative; it needs "
                          + ("what the device can hold" if of_device else "the un-checkpointed peak"))
    return max(1, int(whole * percent / 100))


def is_device_budget(budget: int | str) -> bool:
    """Whether ``budget`` is relative to the device (``"device"``, ``"90% of device"``)."""
    return isinstance(budget, str) and _DEVICE.match(budget) is not None


def check_budget(budget: int | str) -> None:
    """Raises ``BudgetError`` unless ``budget`` is in one of ``ACCEPTED_FORMS`` (a percentage is checked
    without the peak it is relative to): lets callers reject a malformed budget before any work.

    >>> check_budget("60%"), check_budget(4096)
    (None, None)
    """
    _read(budget)


def _read(budget: int | str) -> tuple[int, Fraction | None, bool]:
    """``(bytes, None, False)`` for an absolute budget, ``(0, percent, False)`` for ``"NN%"`` (percent in
    (0, 100]), ``(0, percent, True)`` for ``"device"`` (100) and ``"NN% of device"``."""
    shown = (f"({budget.bit_length()}-bit int)" if isinstance(budget, int) and budget.bit_length() > 128
             else reprlib.repr(budget))  # a budget of 5000 digits is not echoed (nor can Python print it)
    if isinstance(budget, bool) or not isinstance(budget, (int, str)):
        raise BudgetError(f"budget {shown} is not understood; use {ACCEPTED_FORMS}")
    if isinstance(budget, int):
        if not 0 < budget <= MAX_BUDGET_BYTES:
            raise BudgetError(f"budget {shown} must be a positive number of bytes, at most 2**63 - 1; "
                              f"use {ACCEPTED_FORMS}")
        return budget, None, False
    device = _DEVICE.match(budget)
    if device is not None:
        share = Fraction(device.group(1)) if device.group(1) is not None else Fraction(100)
        if not 0 < share <= 100:
            raise BudgetError(f"budget {shown}: a percentage must be in (0, 100]; use {ACCEPTED_FORMS}")
        return 0, share, True
    match = _PATTERN.match(budget)
    if match is None:
        raise BudgetError(f"budget {shown} is not understood; use {ACCEPTED_FORMS}")
    value, unit = Fraction(match.group(1)), match.group(2).upper()
    if unit == "%":
        if not 0 < value <= 100:
            raise BudgetError(f"budget {shown}: a percentage must be in (0, 100]; use {ACCEPTED_FORMS}")
        return 0, value, False
    if unit not in _UNITS:
        raise BudgetError(f"budget {shown} has unknown unit {match.group(2)!r}; use {ACCEPTED_FORMS}")
    if value * _UNITS[unit] > MAX_BUDGET_BYTES:
        raise BudgetError(f"budget {shown} is more than 2**63 - 1 bytes; use {ACCEPTED_FORMS}")
    nbytes = int(value * _UNITS[unit])
    if nbytes <= 0:
        raise BudgetError(f"budget {shown} must be positive; use {ACCEPTED_FORMS}")
    return nbytes, None, False
