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

from planner.capture.inputs import Inputs
from planner.compat.torch_private import tree_leaves
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

    The two op sequences are aligned with ``difflib`` (``matching_blocks``; they differ in view ops:
    unpacking a tensor is one ``unbind`` eagerly but a ``select`` per element when traced); a traced
    op without a match is compared with the last matched eager op before it.

    Args:
        traced: the profiled run's ``(op, live bytes)`` trace of the forward.
        eager: the eager forward's trace.
        node_ops: each node's ``[start, stop)`` range of op indices in ``traced``.

    Returns:
        None when less than 90% of the traced ops could be matched (no correction then).
    """
    blocks = matching_blocks([op for op, _ in traced], [op for op, _ in eager])
    if sum(size for _, _, size in blocks) < 0.9 * len(traced):
        return None
    partner = [-1] * len(traced)
    for a, b, size in blocks:
        for k in range(size):
            partner[a + k] = b + k
    diff, last = [], -1
    for i, (_, live) in enumerate(traced):
        last = partner[i] if partner[i] >= 0 else last
        diff.append(eager[last][1] - live if last >= 0 else 0)
    return [max([0, *diff[start:stop]]) for start, stop in node_ops]


ALIGN_WINDOW = 512
"""Most ops of each trace ``difflib`` aligns at once. Its matching grows faster than quadratically with
the length when the same few ops repeat in every block (a 300-block model's 3300 and 3900 ops took
35 s in one piece), so longer traces are aligned window by window; examples/gpt.py's 533 take 0.01 s."""


RESYNC = 8
"""Most ops skipped in either trace to find the two in step again after a difference, before difflib is asked
(an eager ``detach`` after every activation: one op)."""
RESYNC_RUN = 4
"""Ops that must match after the skip for it to count as in step again."""


def _resync(a: list[str], b: list[str], i: int, j: int) -> tuple[int, int] | None:
    """The nearest ``(i', j')`` past a difference at ``(i, j)``, skipping fewest ops in all, from which
    ``RESYNC_RUN`` ops (or all that are left) match; None when none lies within ``RESYNC`` of it."""
    for total in range(1, 2 * RESYNC + 1):
        for di in range(max(0, total - RESYNC), min(total, RESYNC) + 1):
            dj = total - di
            run = min(RESYNC_RUN, len(a) - i - di, len(b) - j - dj)
            if run > 0 and a[i + di:i + di + run] == b[j + dj:j + dj + run]:
                return i + di, j + dj
    return None


def matching_blocks(a: list[str], b: list[str]) -> list[tuple[int, int, int]]:
    """``(i, j, size)`` with ``a[i:i + size] == b[j:j + size]``, increasing in ``i`` and ``j``: difflib's
    matching blocks, over windows of ``ALIGN_WINDOW`` ops when the traces are longer.

    Each window's matches in its first half are kept (its tail may cut a difference in two) and the
    next window starts after the last of them; the final window, which reaches both ends, keeps all.
    Traces that differ by more than half a window at once stop matching there. Runs the two share op for op
    are matched as they come, and a difference of a few ops is stepped over (``_resync``), without difflib: a
    1,000-block chain's 9,000 ops took difflib 16 s, window by window."""
    blocks: list[tuple[int, int, int]] = []
    i = j = 0
    half = ALIGN_WINDOW // 2
    while i < len(a) and j < len(b):
        same = 0
        while i + same < len(a) and j + same < len(b) and a[i + same] == b[j + same]:
            same += 1
        if same:
            blocks.append((i, j, same))
            i, j = i + same, j + same
            continue
        skip = _resync(a, b, i, j)
        if skip is not None:
            i, j = skip
            continue
        found = difflib.SequenceMatcher(None, a[i:i + ALIGN_WINDOW], b[j:j + ALIGN_WINDOW],
                                        autojunk=False).get_matching_blocks()[:-1]  # the last is a 0-size sentinel
        if i + ALIGN_WINDOW < len(a) or j + ALIGN_WINDOW < len(b):
            found = [m for m in found if m.a < half and m.b < half] or found[:1]
        if not found:
            break
        blocks.extend((i + m.a, j + m.b, m.size) for m in found)
        i, j = i + found[-1].a + found[-1].size, j + found[-1].b + found[-1].size
    return blocks
