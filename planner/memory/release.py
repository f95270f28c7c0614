"""When a kept activation is freed in backward: its release under a given plan.

A storage the forward keeps for backward is held by one or more *holders*, and it is freed once the
backward has passed all of them (backward runs from the last node to the first, so it is alive at
backward node ``t`` iff some holder sits at or before ``t``: its release is the earliest holder):

- a saver no plan checkpoints (``MemoryModel.fixed_release``);
- a saver in a chunk the plan leaves alone (``saver_firsts``: the first saver of each chunk);
- a checkpointed segment that starts after the storage's chunk and reads it: non-reentrant
  checkpointing saves the segment's inputs until its backward has finished, i.e. until the backward
  of the segment's first node (``consumer_chunks``);
- a selective save that caches it while some node of the segment saves it (``first_saver``).

A plan that keeps a storage has at least one holder; the un-checkpointed plan's release is the first
saver, as measured. Every holder reads the storage, so all of them lie at or before its last use.
Torch-free.
"""

from __future__ import annotations

import numpy as np

from planner.memory.model import ChunkPlan, MemoryModel


def segment_starts(model: MemoryModel, plan: ChunkPlan) -> np.ndarray:
    """Per chunk: the first chunk of the plan's segment holding it, -1 outside every segment."""
    start = np.full(model.n_chunks, -1, dtype=np.int64)
    for first, stop in plan:
        start[first:stop] = first
    return start


def release_of(model: MemoryModel, plan: ChunkPlan) -> np.ndarray:
    """Per storage: the node whose backward frees it under ``plan`` (its earliest holder), ``NEVER``
    when nothing holds it (the plan does not keep it, or it is no activation the plan can free)."""
    start = segment_starts(model, plan)
    release = model.fixed_release.copy()
    for s in range(len(release)):
        r = int(release[s])
        for k, u in model.saver_firsts[s]:
            if start[k] < 0:
                r = min(r, u)
        p = model.producer_chunk[s]
        for w in model.consumer_chunks[s]:
            if start[w] > p:
                r = min(r, model.regions.starts[start[w]])
        release[s] = r
    return release
