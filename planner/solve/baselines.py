"""Placements people make by hand, as planners with the solver signature.

``none`` checkpoints nothing; ``every_block`` checkpoints each repeated block on its
own (what most training scripts do: Hugging Face's ``gradient_checkpointing_enable``, torchtitan's full
activation checkpointing); ``sqrt_n`` cuts the blocks (or chunks) into about
√n equal segments and checkpoints all but the last, as ``checkpoint_sequential`` does; ``op_sac`` is
torchtitan's default selective policy: every block checkpointed, keeping the outputs of its matmuls (all but
every second ``mm``), attention kernels and communication ops. They ignore the budget when choosing; the
caller checks the predicted peak.
"""

from __future__ import annotations

import math

from planner.errors import OptionError
from planner.memory.model import ChunkPlan, MemoryModel
from planner.memory.saves import SaveOptions, expressible
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
    """Each block of the model's repeated container (``blocks.0``, ``layers.3``...), or each step of its loop
    (``cell#7``), in its own segment.

    Raises:
        OptionError (a ValueError): the model has neither, or these chunks do not cut at every block's edges.
    """
    if not model.regions.blocks:
        raise OptionError("every_block needs a container of numbered blocks (e.g. an nn.ModuleList `blocks`) or a "
                          "module called in a loop, with a cut at each block's edges; this model has none (or "
                          f"{model.regions.block_count} blocks, more than the chunks): use the sqrt_n or cpsat solver, "
                          "or raise max_chunks")
    return _fixed(model, model.regions.blocks)


def sqrt_n(model: MemoryModel, budget_bytes: int, *, deadline: Deadline | None = None,
           options: SaveOptions | None = None) -> Solution:
    """About √n equal segments over the blocks (or the chunks when there are no blocks); every
    segment but the last is checkpointed, as ``torch.utils.checkpoint.checkpoint_sequential`` does."""
    units = list(model.regions.blocks) or [(k, k + 1) for k in range(model.n_chunks)]
    if not units:
        return _fixed(model, ())
    groups = max(1, round(math.sqrt(len(units))))
    return _fixed(model, tuple(_groups_of(units, math.ceil(len(units) / groups))[:-1]))


def hand_placements(model: MemoryModel) -> list[ChunkPlan]:
    """Every placement by hand over the model's blocks, as ``every_block`` and ``checkpoint_sequential`` make
    them: each block alone, then groups of ``g`` consecutive blocks for ``g`` up to twice √n, every group
    checkpointed and every group but the last; segments the executor cannot run left out (a group of calls with
    the loop's code between them, under hooks). Empty when these chunks do not cut at every block's edges."""
    blocks = list(model.regions.blocks)
    plans = []
    for size in range(1, max(2, 2 * math.isqrt(len(blocks))) + 1) if blocks else ():
        groups = [(a, b) for a, b in _groups_of(blocks, size) if model.regions.allows(a, b)]
        plans += [tuple(groups), tuple(groups[:-1])]
    return plans


def _groups_of(units: list[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """Chunk ranges of consecutive groups of ``size`` units (the last one shorter)."""
    return [(units[i][0], units[min(i + size, len(units)) - 1][1]) for i in range(0, len(units), size)]


OP_SAC_SAVES = frozenset({
    "aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.linear.default", "aten._scaled_mm.default",
    "aten.convolution.default", "aten.convolution_backward.default", "aten.upsample_bilinear2d.default",
    "aten.max.default", "aten.topk.default", "aten.scaled_dot_product_attention",
    "aten._flash_attention_forward.default", "aten._efficient_attention_forward.default",
    "_c10d_functional.reduce_scatter_tensor.default", "_c10d_functional.all_to_all_single.default",
})
"""The ops torchtitan's default selective policy keeps (``torchtitan/distributed/activation_checkpoint.py``: the
partitioner's compute-intensive ops, SDPA variants, ``max``, ``linear``, ``topk``, reduce-scatter and
all-to-all), by the names ``NodeCost.kernels`` records them (every fused attention kernel as
``planner.capture.ops.ATTENTION``)."""
OP_SAC_MATMULS = frozenset({"aten.mm.default", "aten.linear.default"})
"""The ops whose every second call in a block torchtitan's policy re-runs instead of keeping."""


def op_sac(model: MemoryModel, budget_bytes: int, *, deadline: Deadline | None = None,
           options: SaveOptions | None = None) -> Solution:
    """torchtitan's default op-level policy in this cost model: each block checkpointed (``every_block``), keeping
    the nodes whose fresh outputs come from ``OP_SAC_SAVES`` ops, except every second ``mm`` of the block (the
    2nd, 4th... in forward order). Keeps the cost model cannot express exactly (``planner.memory.saves``:
    a keep whose re-run partner lies in another segment) are re-run instead.

    Raises:
        OptionError (a ValueError): the model has no container of numbered blocks, or its profile records no
            op names (``NodeCost.kernels``; a profile from an older ckplan or a hand-made one).
    """
    blocks = every_block(model, budget_bytes).plan
    if not any(model.kernels):
        raise OptionError("op_sac needs the op names each node runs (NodeCost.kernels), which this profile lacks: "
                          "profile the model again with this ckplan")
    saves = set()
    for first, stop in blocks:
        lo, hi = model.regions.starts[first], model.regions.bounds(stop - 1)[1]
        matmuls = 0
        for node in range(lo, hi):
            kept = False
            for name in model.kernels[node]:
                if name in OP_SAC_MATMULS:
                    matmuls += 1
                    kept |= matmuls % 2 == 1
                elif name in OP_SAC_SAVES:
                    kept = True
            if kept:
                saves.add(node)
    saves_ = expressible(model, blocks, frozenset(saves))
    return Solution(plan=blocks, saves=saves_, status=SolverStatus.FIXED,
                    recompute_us=simulate(model, blocks, saves_).recompute_us, bound_us=None, solve_time_s=0.0)
