"""What a plan keeps and re-runs, per storage and per segment: shared by the simulator and the offload model
(``planner.memory.offload``), which both need them. Torch-free."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from planner.memory.model import MemoryModel
from planner.memory.saves import NEVER


def kept_given(model: MemoryModel, release: np.ndarray) -> np.ndarray:
    """Kept storages given the plan's releases: the always-kept ones, and those the plan can free that
    something holds (``planner.memory.release``)."""
    kept = model.always_kept.copy()
    varying = model.varying()
    kept[varying] = release[varying] < NEVER
    return kept


def segment_recompute_us(model: MemoryModel, first: int, stop: int, saves: Iterable[int] = ()) -> int:
    """Recompute time of one checkpointed segment (chunks ``[first, stop)``), microseconds: its forward
    time plus the checkpoint call; when it keeps some of ``saves`` (selective checkpointing; other
    segments' saves are ignored), minus those nodes' forward time plus SAC's dispatch charge over it.
    Every strategy and report counts a segment's cost with this (CP-SAT's objective encodes it)."""
    cost = int(model.chunk_cost_us[first:stop].sum()) - rerun_skip_us(model, first, stop) + model.segment_cost_us
    if not saves:
        return cost
    lo, hi = model.regions.starts[first], model.regions.bounds(stop - 1)[1]
    mine = [o for o in saves if lo <= o < hi]
    if mine:
        cost += int(model.sac_chunk_us[first:stop].sum()) - sum(int(model.node_cost_us[o]) for o in mine)
    return cost


def rerun_skip_us(model: MemoryModel, first: int, stop: int) -> int:
    """Forward time of segment ``[first, stop)`` its re-run never runs: torch stops re-running once the
    last saved tensor is back (``MemoryModel.skip_us``; a segment that saves nothing is never re-run)."""
    if not len(model.skip_us):
        return 0
    last = rerun_chunk(model, first, stop)
    if last is None:
        return int(model.chunk_cost_us[first:stop].sum())
    return int(model.skip_us[last] + model.chunk_cost_us[last + 1:stop].sum())


def rerun_chunk(model: MemoryModel, first: int, stop: int) -> int | None:
    """Chunk whose backward triggers the re-run of segment ``[first, stop)``: its last saving chunk."""
    last = int(model.last_rerun[stop - 1]) if stop > first else -1
    return last if last >= first else None
