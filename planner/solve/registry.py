"""Every planning strategy, as peers with one signature: ``(model, budget_bytes, *, time_limit_s) -> Solution``.

``cpsat`` is the planner; the others are what people do by hand today, kept so
they can be compared with it on the same cost model (``bench/``) and selected with
``optimize(..., solver=...)``. None of them imports torch.
"""

from __future__ import annotations

from typing import Protocol

from planner.solve.baselines import every_block, no_checkpointing, sqrt_n
from planner.solve.rotor import rotor
from planner.memory.simulate import MemoryModel
from planner.solve.result import Solution
from planner.solve.default import solve
from planner.errors import OptionError


class Solver(Protocol):
    def __call__(self, model: MemoryModel, budget_bytes: int, *, time_limit_s: float) -> Solution: ...


SOLVERS: dict[str, Solver] = {
    "cpsat": solve,
    "rotor": rotor,
    "every_block": every_block,
    "sqrt_n": sqrt_n,
    "none": no_checkpointing,
}


def get_solver(name: str) -> Solver:
    """The strategy called ``name``; ``OptionError`` (a ValueError) listing the known ones otherwise."""
    try:
        return SOLVERS[name]
    except KeyError:
        raise OptionError(f"unknown solver {name!r}; choose one of {', '.join(SOLVERS)}") from None
