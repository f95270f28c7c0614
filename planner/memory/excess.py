"""The Python locals of the user's modules: where a plan run as a rewritten graph keeps them.

A module's own forward keeps temporaries alive until their names are rebound (attention's ``q, k, v``
and ``scores``); the traced graph frees every value at its last use. The profile measures the graph
and records, per node, what the eager forward keeps beyond it (``NodeCost.eager_excess_bytes``).

Which code runs depends on the plan. Plans run by module hooks call the user's modules everywhere:
the excess is always there (``MemoryModel.rerun_excess`` adds it to re-runs too). Plans of the fx
rewrite (``planner.rewrite.graph``) *open* a module, i.e. run its traced code instead of its forward,
when a segment boundary falls strictly inside one of its calls or one of its calls lies wholly inside
a segment; every other module runs its own forward. So a node's excess is there exactly when the node
is outside every segment and some module call around it is not opened. The empty plan runs the
model's own forward: no module is opened.

This module computes, per node, the module paths around it and what opens each path, in chunks, for
``simulate`` and the solvers. Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from planner.capture.calls import CallIndex
from planner.memory.model import ChunkPlan, MemoryModel
from planner.memory.regions import Regions
from planner.memory.release import segment_starts
from planner.memory.saves import segment_of
from planner.profiling.record import Profile


@dataclass(frozen=True, slots=True)
class Opening:
    """What opens one module path (all its calls share the path, so opening one opens all)."""

    cuts: tuple[int, ...]
    """Chunks ``j`` at whose start a segment boundary falls strictly inside one of its calls: a segment
    starting at ``j`` or stopping at ``j`` opens it."""
    spans: tuple[tuple[int, int], ...]
    """``(first, last)`` chunks of each call: a segment covering all of them holds the call wholly."""


def opened_paths(calls: CallIndex, ranges: Sequence[tuple[int, int]]) -> set[str]:
    """Module paths whose code the fx rewrite of segments over node ``ranges`` (``[lo, hi)``) opens: a
    boundary falls strictly inside one of its calls, or one of its calls lies wholly inside a segment.
    The rule ``planner.rewrite.graph`` applies; ``openings`` is the same rule per chunk."""
    cuts = {x for r in ranges for x in r}
    return {c.path for c in calls.calls
            if any(c.first < x <= c.last for x in cuts) or any(a <= c.first and c.last < b for a, b in ranges)}


def openings(profile: Profile, regions: Regions) -> tuple[tuple[Opening, ...], tuple[tuple[int, ...], ...]]:
    """``(openers, around)``: what opens each module path (``opened_paths`` per chunk), and per node the
    paths whose calls enclose it (its own call excluded: a module called as one node runs its own forward
    either way). Path 0 is the root: any segment at all replaces the model's forward by generated code.
    Nodes past the last chunk (the loss) get none: their excess is the same under every plan."""
    calls, end = profile.calls, regions.end
    chunk_of = regions.chunk_of()
    paths: dict[str, int] = {"": 0}
    cuts: list[set[int]] = [set(range(regions.n_chunks))]
    spans: list[list[tuple[int, int]]] = [[]]
    for call in calls.calls:
        if call.first >= end:
            continue
        lo, hi = call.first, min(call.last, end - 1)
        p = paths.setdefault(call.path, len(paths))
        if p == len(cuts):
            cuts.append(set())
            spans.append([])
        cuts[p].update(j for j in range(regions.n_chunks) if lo < regions.starts[j] <= hi)
        spans[p].append((chunk_of[lo], chunk_of[hi]))
    around = []
    for i, node in enumerate(profile.nodes):
        enclosing = calls.around[i]
        if enclosing and node.kind == "call_module" and calls.path(enclosing[-1]) == node.target:
            enclosing = enclosing[:-1]
        around.append((0, *sorted({paths[calls.path(c)] for c in enclosing})) if i < end else ())
    openers = tuple(Opening(tuple(sorted(c)), tuple(s)) for c, s in zip(cuts, spans))
    return openers, tuple(around)


def opened(model: MemoryModel, plan: ChunkPlan) -> np.ndarray:
    """Per module path of ``model.openers``: does the rewrite of ``plan`` run its traced code?"""
    boundary = np.zeros(model.n_chunks + 1, dtype=bool)
    for first, stop in plan:
        boundary[first] = boundary[stop] = True
    start = segment_starts(model, plan)
    return np.array([any(boundary[j] for j in o.cuts)
                     or any(start[k1] >= 0 and start[k1] == start[k2] for k1, k2 in o.spans)
                     for o in model.openers], dtype=bool)


def excess_of(model: MemoryModel, plan: ChunkPlan) -> np.ndarray:
    """Per node: the eager excess the planned module keeps during its forward (``model.excess`` where the
    node is outside every segment and some module call around it runs its own forward, else 0)."""
    if not model.excess.any():
        return np.zeros(model.n_nodes, dtype=np.int64)
    is_open = opened(model, plan)
    inside = segment_of(model, plan) >= 0
    eager = np.array([not inside[t] and any(not is_open[p] for p in model.around[t]) for t in range(model.n_nodes)])
    return np.where(eager, model.excess, 0)
