"""``Deadline``: when the solve stage must stop, passed down to every strategy (torch-free).

``optimize(time_limit_s=...)`` becomes one ``Deadline`` when the solve stage starts; every DP, CP-SAT
search and finer chunking below it asks the same object how much time is left, so the limit bounds the
whole stage. Tests inject a clock instead of sleeping.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Deadline:
    """A moment on ``clock`` (seconds, ``time.perf_counter`` by default) past which work must stop."""

    at: float
    """The moment, in ``clock``'s seconds."""
    clock: Callable[[], float] = field(default=time.perf_counter, compare=False)

    @classmethod
    def after(cls, seconds: float, *, clock: Callable[[], float] = time.perf_counter) -> Deadline:
        """The deadline ``seconds`` from now."""
        return cls(clock() + seconds, clock)

    def left_s(self) -> float:
        """Seconds left, never below 0."""
        return max(0.0, self.at - self.clock())

    @property
    def passed(self) -> bool:
        return self.clock() > self.at

    def within(self, seconds: float) -> Deadline:
        """This deadline or ``seconds`` from now, whichever comes first."""
        return Deadline(min(self.at, self.clock() + seconds), self.clock)
