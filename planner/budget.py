"""Parses the user's memory budget, once, into bytes.

Accepted forms: an int (bytes), ``"4GB"``/``"512MB"``/``"64KB"`` (powers of 10),
``"4GiB"``/``"512MiB"``/``"64KiB"`` (powers of 2), ``"123B"``, and ``"60%"``
(of the un-checkpointed predicted peak).
"""

from __future__ import annotations

import re

from planner.errors import BudgetError
from planner.units import format_bytes  # noqa: F401 - re-exported: budgets and byte counts go together

ACCEPTED_FORMS = "an int of bytes, '4GB', '4GiB', '512MB', '512MiB', '64KB', '64KiB', '1000B' or '60%'"

_UNITS = {
    "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]+|%)\s*$")


def parse_budget(budget: int | str, *, baseline_peak_bytes: int | None = None) -> int:
    """Converts a budget to bytes.

    Args:
        budget: int bytes or a string in one of ``ACCEPTED_FORMS``.
        baseline_peak_bytes: the un-checkpointed peak, needed for ``"NN%"`` budgets.

    Returns:
        The budget in bytes.

    Raises:
        BudgetError (a ValueError): the budget is malformed, non-positive or a percentage over 100,
            or a percentage without ``baseline_peak_bytes``.

    >>> parse_budget("4GB"), parse_budget("1KiB"), parse_budget("50%", baseline_peak_bytes=300)
    (4000000000, 1024, 150)
    """
    nbytes, percent = _read(budget)
    if percent is None:
        return nbytes
    if baseline_peak_bytes is None:
        raise BudgetError(f"budget {budget!r} is relative; it needs the un-checkpointed peak")
    return max(1, int(baseline_peak_bytes * percent / 100))


def check_budget(budget: int | str) -> None:
    """Raises ``BudgetError`` unless ``budget`` is in one of ``ACCEPTED_FORMS`` (a percentage is checked
    without the peak it is relative to): lets callers reject a malformed budget before any work.

    >>> check_budget("60%"), check_budget(4096)
    (None, None)
    """
    _read(budget)


def _read(budget: int | str) -> tuple[int, float | None]:
    """``(bytes, None)`` for an absolute budget, ``(0, percent)`` for ``"NN%"`` (percent in (0, 100])."""
    if isinstance(budget, bool) or not isinstance(budget, (int, str)):
        raise BudgetError(f"budget {budget!r} is not understood; use {ACCEPTED_FORMS}")
    if isinstance(budget, int):
        if budget <= 0:
            raise BudgetError(f"budget {budget} must be a positive number of bytes; use {ACCEPTED_FORMS}")
        return budget, None
    match = _PATTERN.match(budget)
    if match is None:
        raise BudgetError(f"budget {budget!r} is not understood; use {ACCEPTED_FORMS}")
    value, unit = float(match.group(1)), match.group(2).upper()
    if unit == "%":
        if not 0 < value <= 100:
            raise BudgetError(f"budget {budget!r}: a percentage must be in (0, 100]; use {ACCEPTED_FORMS}")
        return 0, value
    if unit not in _UNITS:
        raise BudgetError(f"budget {budget!r} has unknown unit {match.group(2)!r}; use {ACCEPTED_FORMS}")
    nbytes = int(value * _UNITS[unit])
    if nbytes <= 0:
        raise BudgetError(f"budget {budget!r} must be positive; use {ACCEPTED_FORMS}")
    return nbytes, None
