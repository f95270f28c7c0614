"""Every planning strategy, as peers with one signature: ``(model, budget_bytes, *, deadline, options) -> Solution``.

``cpsat`` is the planner; the others are what people do by hand today, kept so
they can be compared with it on the same cost model (``bench/``) and selected with
``optimize(..., solver=...)``. None of them imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from planner.errors import OptionError
from planner.memory.model import MemoryModel
from planner.memory.saves import SaveOptions
from planner.solve.baselines import every_block, no_checkpointing, op_sac, sqrt_n
from planner.solve.deadline import Deadline
from planner.solve.default import solve
from planner.solve.result import Solution
from planner.solve.rotor import rotor


class Solver(Protocol):
    """A strategy: the plan for ``budget_bytes`` found before ``deadline``; ``options`` (op-level saves,
    overrides) are read by the strategies whose ``Capabilities.saves`` says so, ignored by the others."""

    def __call__(self, model: MemoryModel, budget_bytes: int, *, deadline: Deadline,
                 options: SaveOptions | None = None) -> Solution: ...


SOLVERS: dict[str, Solver] = {
    "cpsat": solve,
    "rotor": rotor,
    "every_block": every_block,
    "sqrt_n": sqrt_n,
    "op_sac": op_sac,
    "none": no_checkpointing,
}


@dataclass(frozen=True, kw_only=True, slots=True)
class Capabilities:
    """What a strategy can do, so callers ask this instead of comparing names."""

    reads_budget: bool
    """It chooses its plan for the budget (the fixed placements do not)."""
    proves_optimal: bool
    """Its status can be OPTIMAL: least recompute under the cost model, with a proven bound."""
    saves: bool
    """It places op-level saves (selective checkpointing) and honours must_save/must_recompute."""
    own_saves: bool = False
    """It keeps op outputs of its own choosing, by a fixed rule (a hand policy: ``op_sac``)."""


CAPABILITIES: dict[str, Capabilities] = {
    "cpsat": Capabilities(reads_budget=True, proves_optimal=True, saves=True),
    "rotor": Capabilities(reads_budget=True, proves_optimal=True, saves=False),  # when its DP is exact
    "every_block": Capabilities(reads_budget=False, proves_optimal=False, saves=False),
    "sqrt_n": Capabilities(reads_budget=False, proves_optimal=False, saves=False),
    "op_sac": Capabilities(reads_budget=False, proves_optimal=False, saves=False, own_saves=True),
    "none": Capabilities(reads_budget=False, proves_optimal=False, saves=False),
}
"""Per entry of ``SOLVERS``."""


def capabilities(name: str) -> Capabilities:
    """What the strategy called ``name`` can do (``OptionError`` for an unknown name)."""
    get_solver(name)
    return CAPABILITIES[name]


def get_solver(name: str) -> Solver:
    """The strategy called ``name``; ``OptionError`` (a ValueError) listing the known ones otherwise."""
    try:
        return SOLVERS[name]
    except KeyError:
        raise OptionError(f"unknown solver {name!r}; choose one of {', '.join(SOLVERS)}") from None
