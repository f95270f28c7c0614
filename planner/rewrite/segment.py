"""``Segment``: one checkpointed run of the graph, as the plan records it and the executors run it, and
``segments_of``, which makes them from a solution (torch-free)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from planner.memory.model import ChunkPlan, MemoryModel
from planner.memory.regions import Regions
from planner.memory.simulate import freed_bytes, segment_recompute_us
from planner.profiling.record import Profile


@dataclass(frozen=True, kw_only=True, slots=True)
class Segment:
    """One checkpointed run of the graph."""

    nodes: tuple[str, ...]
    """Graph node names, in order."""
    module_paths: tuple[str, ...]
    """Modules whose calls lie wholly inside, outermost first; ``path:op`` for loose ops."""
    recompute_ms: float
    """Forward time re-run in backward, ms."""
    freed_bytes: int = 0
    """Activation bytes it stops keeping until backward, net of the inputs it keeps."""
    restore_buffers: tuple[str, ...] = ()
    """Buffers restored after recomputation (BatchNorm running statistics)."""
    saved_nodes: tuple[str, ...] = ()
    """Nodes whose outputs are kept, not re-run (selective checkpointing inside the segment)."""
    chain: tuple[str, ...] = ()
    """Plans run by module hooks: the module calls the segment consists of, consecutive siblings in call
    order; empty for a rewritten graph."""
    saved_ops: tuple[tuple[str, int], ...] = ()
    """Plans run by module hooks: the ops whose fresh outputs selective checkpointing keeps, each as (op name,
    its occurrence among the segment's ops of that name, from 0), in the order the segment's forward runs them:
    the kernels (``NodeCost.kernels``) of its saved nodes."""
    random: bool = True
    """Its forward draws random numbers (dropout), so its checkpoint stashes the RNG state to re-run it alike
    (``preserve_rng_state``); a segment that draws none stashes nothing. True in plans saved without it."""


def segments_of(prof: Profile, regions: Regions, memory: MemoryModel, plan: ChunkPlan,
                saves: frozenset = frozenset()) -> tuple[Segment, ...]:
    """The ``Segment`` records of a chunk plan (with its op-level saves): nodes, module paths, recompute time,
    bytes freed, buffers to restore, kept nodes, and for plans run by hooks their chain of module calls."""
    out = []
    for (first, stop), freed in zip(plan, freed_bytes(memory, plan)):
        lo, hi = regions.starts[first], regions.bounds(stop - 1)[1]
        nodes = prof.nodes[lo:hi]
        mine = sorted(o for o in saves if lo <= o < hi)
        out.append(Segment(
            nodes=tuple(n.name for n in nodes),
            module_paths=_covering_paths(prof, lo, hi),
            recompute_ms=segment_recompute_us(memory, first, stop, mine) / 1000,
            freed_bytes=freed,
            restore_buffers=tuple(dict.fromkeys(b for n in nodes for b in n.mutated_buffers)),
            saved_nodes=tuple(prof.nodes[o].name for o in mine),
            chain=regions.chains[first, stop] if regions.chains is not None else (),
            saved_ops=_kernels(prof, lo, hi, set(mine)) if regions.chains is not None else (),
            random=any(n.random for n in nodes),
        ))
    return tuple(out)


def _kernels(prof: Profile, lo: int, hi: int, saved: set[int]) -> tuple[tuple[str, int], ...]:
    """The kernels of the ``saved`` nodes among nodes ``lo:hi``, each named by its occurrence among the
    same-named kernels of those nodes: how the segment's selective-checkpointing policy finds them as they run."""
    seen: Counter[str] = Counter()
    out = []
    for i in range(lo, hi):
        for name in prof.nodes[i].kernels:
            if i in saved:
                out.append((name, seen[name]))
            seen[name] += 1
    return tuple(out)


def _covering_paths(prof: Profile, lo: int, hi: int) -> tuple[str, ...]:
    """Outermost module calls wholly inside nodes ``lo:hi``, and ``path:op`` for ops outside them."""
    calls = prof.calls
    paths: dict[str, None] = {}
    for i in range(lo, hi):
        node = prof.nodes[i]
        whole = next((c for c in calls.around[i] if lo <= calls.calls[c].first and calls.calls[c].last < hi), None)
        if whole is not None:
            paths.setdefault(calls.path(whole), None)
        elif node.kind != "get_attr":
            paths.setdefault(f"{node.module_path or '<root>'}:{node.target.rsplit('.', 1)[-1]}", None)
    return tuple(paths)
