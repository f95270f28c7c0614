"""Which single nodes a plan may save inside its segments, and the user's overrides, as node indices.

Selective checkpointing at planning time, torch-free: the executor says which nodes it can keep
(``SegmentRules.savable``: one fresh-output, non-random op per node, never one that writes buffers);
a candidate must also be exact in the memory model (``planner.memory.saves.cacheable``: every output
saved for backward). To keep CP-SAT small, each block keeps its ``per_block`` candidates with the most
forward time per cached byte. ``must_save``/``must_recompute`` patterns (``planner.common.patterns``) become
node indices here.
"""

from __future__ import annotations

from collections.abc import Sequence

from planner.common.patterns import matches
from planner.errors import OptionError
from planner.memory.model import MemoryModel
from planner.memory.saves import SaveOptions, cacheable, cached
from planner.profiling.record import Profile


def save_options(profile: Profile, memory: MemoryModel, *, savable: frozenset[int] | None,
                 must_save: Sequence[str] = (), must_recompute: Sequence[str] = (), selective: bool = True,
                 per_block: int = 8) -> SaveOptions:
    """The candidates (when ``selective``) and the overrides of one prepared model.

    ``savable``: the nodes the executor can save (``SegmentRules.savable``: single ops for a rewritten
    graph and for plans run by module hooks, those whose kernels the profile names); None for any node. A ``must_save``
    node the executor cannot keep stays outside every segment.

    Raises:
        OptionError (a ValueError): a pattern matches no node, or asks to re-run a node no segment can hold.
    """
    save = _resolve(profile, must_save, "must_save")
    recompute = _resolve(profile, must_recompute, "must_recompute")
    owner = memory.regions.chunk_of()
    for o in sorted(recompute):
        if o >= len(owner) or not memory.regions.checkpointable[owner[o]]:
            raise OptionError(f"must_recompute matches {profile.nodes[o].name}, which no checkpointed segment "
                              "can hold (it writes an input in place, or it is the loss)")
    both = save & recompute
    if both:
        raise OptionError(f"{profile.nodes[min(both)].name} matches both must_save and must_recompute")
    candidates: tuple[int, ...] = ()
    # (under autocast the parameter casts it caches are never saved, and run past SAC's counters:
    # planner.rewrite.sac.autocast_safe)
    if selective:
        ok = [i for i, nd in enumerate(profile.nodes[:memory.regions.end])
              if not nd.mutated_buffers and cacheable(memory, i) and (savable is None or i in savable)]
        # a save must at least pay for SAC's dispatch cost over its own chunk (a heuristic cut: several
        # cheap saves sharing one segment could pay together), so CP-SAT only runs when saves can win
        # and be worth a CP-SAT variable: at least MIN_SHARE of the forward time of a block (or of the model
        # outside blocks, when it has none)
        floor = MIN_SHARE * _block_us(memory)
        worth = [o for o in ok if memory.node_cost_us[o] > max(floor, memory.sac_chunk_us[owner[o]]
                                                               if len(memory.sac_chunk_us) else 0)]
        candidates = tuple(sorted(set(_best_per_block(memory, worth, per_block)) | (save & set(ok))))
    return SaveOptions(candidates=candidates, must_save=frozenset(save), must_recompute=frozenset(recompute))


MIN_SHARE = 0.01
"""Least share of a block's forward time a candidate save must spare to be offered to the solvers: the many
tiny ops of a layer (an ``rsqrt``, a scale) can never pay for a CP-SAT variable, and would crowd the
``per_block`` best out of the candidates."""


def _block_us(memory: MemoryModel) -> float:
    """Forward time of a typical block, microseconds: the median over the model's blocks, else the whole
    checkpointable forward."""
    if memory.regions.blocks:
        times = sorted(int(memory.node_cost_us[memory.regions.starts[a]:memory.regions.bounds(b - 1)[1]].sum())
                       for a, b in memory.regions.blocks)
        return float(times[len(times) // 2])
    return float(memory.node_cost_us[:memory.regions.end].sum())


def _best_per_block(memory: MemoryModel, nodes: list[int], per_block: int) -> list[int]:
    """The ``per_block`` nodes of each block (and of what lies outside blocks) with the most forward
    time per cached byte."""
    owner = memory.regions.chunk_of()
    block_of = {}
    for b, (first, stop) in enumerate(memory.regions.blocks):
        for k in range(first, stop):
            block_of[k] = b
    groups: dict[int, list[int]] = {}
    for o in nodes:
        groups.setdefault(block_of.get(owner[o], -1), []).append(o)
    out = []
    for members in groups.values():
        members.sort(key=lambda o: -memory.node_cost_us[o] / max(1, int(memory.size[cached(memory, o)].sum())))
        out.extend(members[:per_block])
    return out


def _resolve(profile: Profile, patterns: Sequence[str], what: str) -> set[int]:
    """Node indices matched by glob patterns (``planner.common.patterns``) on module paths, node names and op names."""
    if isinstance(patterns, str):
        patterns = [patterns]
    out: set[int] = set()
    for pattern in patterns:
        if not isinstance(pattern, str) or not pattern:
            raise OptionError(f"{what} takes module paths or op names (glob patterns), got {pattern!r}")
        hits = {i for i, nd in enumerate(profile.nodes[:-1]) if nd.kind != "get_attr" and any(
            matches(pattern, text) for text in _names(profile, i))}
        if not hits:
            raise OptionError(f"{what} pattern {pattern!r} matches no module path or op name of the graph")
        out |= hits
    return out


def _names(profile: Profile, i: int) -> tuple[str, ...]:
    """What a pattern can match: the node name, its module path and the paths of the modules around it,
    the op it calls, ``path:op``, and the ops it dispatches (``NodeCost.kernels``: ``aten.mm.default`` and
    ``mm``, so that ``*mm*`` names every matmul however the model calls it)."""
    node = profile.nodes[i]
    op = node.target.rsplit(".", 1)[-1]
    paths = tuple(dict.fromkeys(profile.calls.paths_around(i)))
    kernels = tuple(name for kernel in node.kernels for name in (kernel, *kernel.split(".")[1:2]))
    return (node.name, node.module_path, node.target, op, f"{node.module_path}:{op}", *paths, *kernels)
