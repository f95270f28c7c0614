"""Placements people make by hand, as planners with the solver signature.

``none`` checkpoints nothing; ``every_block`` checkpoints each repeated block on its
own (what most training scripts do); ``sqrt_n`` cuts the blocks (or chunks) into about
√n equal segments and checkpoints all but the last, as ``checkpoint_sequential`` does.
They ignore the budget when choosing; the caller checks the predicted peak.
"""

from __future__ import annotations

import math

from planner.errors import OptionError
from planner.memory.model import ChunkPlan, MemoryModel
from planner.memory.saves import SaveOptions
from planner.memory.simulate import simulate
from planner.solve.deadline import Deadline
from planner.solve.result import Solution, SolverStatus


def _fixed(model: MemoryModel, plan: ChunkPlan) -> Solution:
    plan = tuple((a, b) for a, b in plan if model.regions.allows(a, b))
    return Solution(plan=plan, status=SolverStatus.FIXED, recompute_us=simulate(model, plan).recompute_us,
                    bound_us=None, solve_time_s=0.0)


def no_checkpointing(model: MemoryModel, budget_bytes: int, *, deadline: Deadline | None = None,
                     options: SaveOptions | None = None) -> Solution:
    """Nothing recomputed: the un-checkpointed step."""
    return _fixed(model, ())


def every_block(model: MemoryModel, budget_bytes: int, *, deadline: Deadline | None = None,
                options: SaveOptions | None = None) -> Solution:
    """Each block of the model's repeated container (``blocks.0``, ``layers.3``...) in its own segment.

    Raises:
        OptionError (a ValueError): the model has no container of numbered blocks.
    """
    if not model.regions.blocks:
        raise OptionError("every_block needs a container of numbered blocks (e.g. an nn.ModuleList "
                          "`blocks`); this model has none: use the sqrt_n or cpsat solver")
    return _fixed(model, model.regions.blocks)


def sqrt_n(model: MemoryModel, budget_bytes: int, *, deadline: Deadline | None = None,
           options: SaveOptions | None = None) -> Solution:
    """About √n equal segments over the blocks (or the chunks when there are no blocks); every
    segment but the last is checkpointed, as ``torch.utils.checkpoint.checkpoint_sequential`` does."""
    units = list(model.regions.blocks) or [(k, k + 1) for k in range(model.n_chunks)]
    if not units:
        return _fixed(model, ())
    groups = max(1, round(math.sqrt(len(units))))
    size = math.ceil(len(units) / groups)
    plan = [(units[i][0], units[min(i + size, len(units)) - 1][1]) for i in range(0, len(units), size)]
    return _fixed(model, tuple(plan[:-1]))
