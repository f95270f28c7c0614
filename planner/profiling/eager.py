"""How much more memory the model's own (eager) forward keeps alive than the traced graph.

The profile replays the traced graph, which frees every value at its last use. A module's
Python ``forward`` keeps its local variables alive until they are rebound or the call
returns (``q, k, v = qkv.split(...)`` holds ``qkv`` through the rest of the block). Outside
checkpointed segments the planned module calls the user's modules, so that excess is real
memory during the forward. It is measured by running the model's forward once more, eagerly,
and comparing live bytes op by op: both runs execute the same ATen ops in the same order.
"""

from __future__ import annotations

import difflib

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from planner.capture.inputs import Inputs
from planner.profiling.memtrack import LiveStorages


def eager_forward_trace(model: nn.Module, inputs: Inputs, device: torch.device) -> list[tuple[str, int]]:
    """``(op, live bytes)`` after every ATen op of one eager forward of ``model``."""
    tracker = LiveStorages(device)
    for tensor in list(model.parameters()) + list(model.buffers()) + list(tree_leaves((inputs.args, inputs.kwargs))):
        if isinstance(tensor, torch.Tensor):
            tracker.track(tensor)
    tracker.trace = []
    with tracker:
        output = model(*inputs.args, **inputs.kwargs)
    del output
    torch.clear_autocast_cache()  # a forward without backward leaves autocast's casts cached
    return tracker.trace


def eager_excess(traced: list[tuple[str, int]], eager: list[tuple[str, int]],
                 node_ops: list[tuple[int, int]]) -> list[int] | None:
    """Per node: the largest excess of eager over traced live bytes during its ops (never below 0).

    The two op sequences are aligned with ``difflib`` (they differ in view ops: unpacking a
    tensor is one ``unbind`` eagerly but a ``select`` per element when traced); a traced op
    without a match is compared with the last matched eager op before it.

    Args:
        traced: the profiled run's ``(op, live bytes)`` trace of the forward.
        eager: the eager forward's trace.
        node_ops: each node's ``[start, stop)`` range of op indices in ``traced``.

    Returns:
        None when less than 90% of the traced ops could be matched (no correction then).
    """
    matcher = difflib.SequenceMatcher(None, [op for op, _ in traced], [op for op, _ in eager], autojunk=False)
    blocks = matcher.get_matching_blocks()
    if sum(b.size for b in blocks) < 0.9 * len(traced):
        return None
    partner = [-1] * len(traced)
    for block in blocks:
        for k in range(block.size):
            partner[block.a + k] = block.b + k
    diff, last = [], -1
    for i, (_, live) in enumerate(traced):
        last = partner[i] if partner[i] >= 0 else last
        diff.append(eager[last][1] - live if last >= 0 else 0)
    return [max([0, *diff[start:stop]]) for start, stop in node_ops]
