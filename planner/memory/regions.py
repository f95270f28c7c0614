"""Cuts the graph into chunks: the places where a checkpointed segment may start or end.

A segment is a run of consecutive chunks. Cut positions are chosen at module
boundaries first (between blocks, then between the submodules of a block), and
among positions of equal depth those where the fewest activation bytes cross
the cut, because a segment keeps everything that crosses into it; each block (or
module call, outside the repeated blocks) gets its best cut before any gets two.
Where a tier of equally good positions does not fit whole in ``max_chunks`` (the
edges of a chain of hundreds of blocks, the steps of an unrolled loop), its cuts are
spread so that the chunks carry balanced cost: groups of n/k blocks for k chunks.
Blocks are a container's numbered children or, without one, the calls of a module
called in a loop (``loop_steps``). A position is never a cut when a tensor crossing
it is modified in place later: the segment would be recomputed from the modified value.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from planner.capture.calls import CallIndex, ModuleCall, member, repeated_blocks
from planner.memory.rules import ANY_RUN, SegmentRules
from planner.profiling.record import Profile


@dataclass(frozen=True, kw_only=True, slots=True)
class Regions:
    """Chunks of the graph, in execution order."""

    starts: tuple[int, ...]
    """Node index at which each chunk starts; chunk ``k`` is ``starts[k]:starts[k+1]``."""
    end: int
    """One past the last node that may be checkpointed (the loss comes after)."""
    checkpointable: tuple[bool, ...]
    """Per chunk: False when checkpointing it would recompute from mutated inputs."""
    blocks: tuple[tuple[int, int], ...] = ()
    """Chunk ranges ``(first, stop)`` of the calls of the model's repeated blocks, if any."""
    block_paths: tuple[str, ...] = ()
    """Name of each block: its module path (children of the largest container of numbered submodules), or the
    call of a module called in a loop (``cell#7``, ``loop_steps``)."""
    block_count: int = 0
    """How many blocks the graph has, whether or not these chunks cut at every block's edges (``blocks``
    is empty then)."""
    block_cuts: int = 0
    """How many cut positions the blocks' edges are (one per block and one more for a chain, two per call of a
    loop run by module hooks): the chunks ``max_chunks = block_cuts + 1`` gives hold every block."""
    capped: bool = False
    """True when the graph has more admissible cut positions than ``max_chunks`` allowed: a plan may
    exist among finer chunks that these do not contain."""
    chains: Mapping[tuple[int, int], tuple[str, ...]] | None = None
    """The chunk ranges ``(first, stop)`` that are the executor's spans (``SegmentRules.spans``: chains
    of module calls), each with its members' paths; only these may be segments. None: any run of
    checkpointable chunks may be one (a rewritten graph)."""
    rules: SegmentRules = ANY_RUN
    """What the executor allows (``planner.rewrite.executor``)."""
    reach: tuple[int, ...] = field(init=False, repr=False, compare=False)
    """Per chunk: one past the last chunk of the run of checkpointable chunks it starts (itself when it is not
    checkpointable), so that ``allows`` answers in constant time inside the solvers' loops over chunk pairs."""

    def __post_init__(self) -> None:
        reach, after = [0] * len(self.checkpointable), len(self.checkpointable)
        for k in range(len(self.checkpointable) - 1, -1, -1):
            after = after if self.checkpointable[k] else k
            reach[k] = after
        object.__setattr__(self, "reach", tuple(reach))

    @property
    def n_chunks(self) -> int:
        return len(self.starts)

    def bounds(self, chunk: int) -> tuple[int, int]:
        """Node range ``[first, stop)`` of a chunk."""
        stop = self.starts[chunk + 1] if chunk + 1 < len(self.starts) else self.end
        return self.starts[chunk], stop

    def allows(self, first: int, stop: int) -> bool:
        """Whether chunks ``first..stop-1`` may form one checkpointed segment."""
        return (stop <= (self.reach[first] if first < len(self.reach) else first)
                and (self.chains is None or (first, stop) in self.chains))

    def chunk_of(self) -> list[int]:
        """Chunk index of every node (``-1`` for nodes after ``end``)."""
        owner = [-1] * self.end
        for k in range(self.n_chunks):
            first, stop = self.bounds(k)
            owner[first:stop] = [k] * (stop - first)
        return owner


def checkpointable_end(profile: Profile) -> int:
    """One past the last node a segment may hold (the loss and what follows it are never checkpointed)."""
    return next((i for i, n in enumerate(profile.nodes) if not n.checkpointable), len(profile.nodes))


DEFAULT_CHUNKS = 64
"""Chunks a search starts with when ``max_chunks`` is not given, for a model of up to 32 repeated blocks; one of
33 to ``PER_BLOCK_UP_TO`` starts with two per block (a Llama-70B's 80 layers: 160, 405B's 126: 252), so that
every block can be a segment; deeper chains of small blocks start at 64 again (their solves grow with the
square of the chunks, and finer chunkings follow while they pay)."""
PER_BLOCK_UP_TO = 128
"""Deepest model whose search starts with two cut positions per repeated block."""


def find_regions(profile: Profile, *, max_chunks: int | None = None, rules: SegmentRules = ANY_RUN) -> Regions:
    """Chooses at most ``max_chunks`` chunks for ``profile``'s graph.

    Args:
        profile: the profiled step.
        max_chunks: upper bound on the number of chunks (the solver's size grows
            with its square); None: ``DEFAULT_CHUNKS``, or two per repeated block for a deeper model.
        rules: what the executor allows; with ``rules.spans`` (plans run by module hooks) cuts lie only
            at the edges of spans and only spans may be segments (``Regions.chains``).
    """
    end = checkpointable_end(profile)
    if end == 0:
        return Regions(starts=(), end=0, checkpointable=(), rules=rules)
    last_use = _last_use(profile)
    mutated_after = _mutation_spans(profile)
    crossing = np.zeros(end + 2, dtype=np.int64)  # bytes of activations live across each position
    for s, storage in enumerate(profile.storages):
        if storage.producer >= 0 and storage.producer < end:
            crossing[storage.producer + 1] += storage.nbytes
            crossing[min(last_use[s], end) + 1] -= storage.nbytes
    crossing = np.cumsum(crossing)
    block_paths, block_nodes = find_blocks(profile, end, calls_only=rules.spans is not None)
    if max_chunks is None:
        per_block = 2 * len(block_nodes)
        max_chunks = per_block if DEFAULT_CHUNKS < per_block <= 2 * PER_BLOCK_UP_TO else DEFAULT_CHUNKS
    tiers = _tiers(profile, end, crossing, block_nodes, rules, mutated_after)
    chosen = _choose(tiers, max(0, max_chunks - 1), block_nodes, _cumulative_cost(profile, end),
                     whole_calls=rules.spans is not None)
    starts = (0, *chosen)
    stops = (*chosen, end)
    checkpointable = tuple(
        not any(p < first and first <= m < stop for p, m in mutated_after)
        for first, stop in zip(starts, stops)
    )
    index = {b: k for k, b in enumerate(starts)} | {end: len(starts)}
    blocks = tuple((index[first], index[stop]) for first, stop in block_nodes
                   if first in index and stop in index)
    if len(blocks) != len(block_nodes):  # a block edge could not be cut (in-place hazard)
        blocks, block_paths = (), ()
    chains = None
    if rules.spans is not None:
        chains = {(index[c.lo], index[c.hi]): c.members for c in rules.spans if c.lo in index and c.hi in index}
    return Regions(starts=starts, end=end, checkpointable=checkpointable, blocks=blocks, block_paths=block_paths,
                   block_count=len(block_nodes),
                   block_cuts=len({b for block in block_nodes for b in block} - {0, end}),
                   capped=sum(map(len, tiers.values())) > len(chosen), chains=chains, rules=rules)


def find_blocks(profile: Profile, end: int, *,
                calls_only: bool = False) -> tuple[tuple[str, ...], list[tuple[int, int]]]:
    """The model's repeated blocks among the modules the graph calls (``scope.repeated_blocks``:
    ``blocks.0``, ``layers.3``, ``transformer.h.11``), else the steps of a loop (``loop_steps``; ``calls_only``:
    each step its call alone, for plans run by module hooks, which can checkpoint the call and not the loop's code).

    Returns their names and node ranges ``[first, stop)``, or nothing when there are neither, or the
    blocks' calls are not contiguous, disjoint runs of nodes.
    """
    calls = profile.calls.nodes_by_path(end)
    blocks = repeated_blocks(calls)
    if len(blocks) < 2:
        return loop_steps(profile.calls, end, calls_only=calls_only)
    paths = sorted(blocks, key=lambda c: calls[c][0])
    ranges = [(calls[c][0], calls[c][-1] + 1) for c in paths]
    contiguous = all(len(calls[c]) == hi - lo for c, (lo, hi) in zip(paths, ranges))
    disjoint = all(a[1] <= b[0] for a, b in itertools.pairwise(ranges))
    return (tuple(paths), ranges) if contiguous and disjoint else ((), [])


def loop_steps(calls: CallIndex, end: int, *,
               calls_only: bool = False) -> tuple[tuple[str, ...], list[tuple[int, int]]]:
    """The steps of a loop: the calls of the module called most often (at least twice) from one place, one
    after another (an ``LSTMCell`` unrolled over time, a shared block applied N times). Step ``i`` runs from
    the end of call ``i - 1`` to the end of call ``i``: the loop's own code between calls (``x[:, t]``) goes
    with the call it feeds (``calls_only``: the call alone). Names are chain members (``cell#3``,
    ``capture.calls.member``)."""
    runs: dict[tuple[str, int | None], list[ModuleCall]] = {}
    for call in calls.calls:
        if call.last < end and call.contiguous and call.single_parent:
            runs.setdefault((call.path, call.parent), []).append(call)
    steps = max((run for run in runs.values() if len(run) >= 2
                 and all(a.last < b.first for a, b in itertools.pairwise(run))), key=len, default=[])
    ranges = [(call.first if i == 0 or calls_only else steps[i - 1].last + 1, call.last + 1)
              for i, call in enumerate(steps)]
    return tuple(member(call.path, call.index) for call in steps), ranges


def _tiers(profile: Profile, end: int, crossing: np.ndarray, block_nodes: list[tuple[int, int]],
           rules: SegmentRules, mutated_after: list[tuple[int, int]]) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """Cut positions ``(crossing bytes, position)`` by tier ``(depth, rank)``: block edges (depth -1), then
    shallower module boundaries; within a block (or, outside the blocks, a module call) fewer crossing bytes
    first, a block's k-th best cut in tier k, so that every block can be cut inside before any is cut twice.
    Positions outside any block or call (the chain itself) form one tier per depth. With ``rules.spans``,
    only the spans' edges; never a position a later in-place write makes unsafe."""
    block_edges = {b for block in block_nodes for b in block}
    block_firsts = [first for first, _ in block_nodes]
    found = [s for s in rules.spans if s.hi <= end] if rules.spans is not None else []
    chain_edges = {b for chain in found for b in (chain.lo, chain.hi)}
    groups: dict[tuple[int, int | str | None], list[tuple[int, int]]] = {}  # (depth, block or call): cuts
    for b in range(1, end):
        if rules.spans is not None and b not in chain_edges:
            continue
        if any(p < b <= m for p, m in mutated_after):
            continue
        depth = -1 if b in block_edges else profile.calls.common_depth(b - 1, b)
        inside = bisect.bisect_right(block_firsts, b) - 1
        unit: int | str | None = inside if inside >= 0 and b < block_nodes[inside][1] else None
        if unit is None and depth > 0:  # outside the repeated blocks: the module call the cut lies in
            unit = profile.calls.calls[profile.calls.around[b][depth - 1]].entry  # (DenseNet's dense layers)
        groups.setdefault((depth, unit), []).append((int(crossing[b]), b))
    tiers: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for (depth, unit), members in groups.items():
        for rank, cut in enumerate(sorted(members)):
            tiers.setdefault((depth, 0 if unit is None else rank), []).append(cut)
    return tiers


def _choose(tiers: dict[tuple[int, int], list[tuple[int, int]]], room: int, block_nodes: list[tuple[int, int]],
            cost: np.ndarray, *, whole_calls: bool) -> list[int]:
    """At most ``room`` cuts, sorted: whole tiers in order while they fit, then the next one spread over the graph
    (``_spread``). ``whole_calls`` (plans run by hooks): when the blocks are a loop's calls with the loop's code
    between them, a call is a segment only when both its edges are cuts, so whole calls are spread instead."""
    chosen: list[int] = []
    apart = whole_calls and any(a[1] < b[0] for a, b in itertools.pairwise(block_nodes))
    end = len(cost) - 1
    for tier in sorted(tiers):
        members = tiers[tier]
        left = room - len(chosen)
        if len(members) <= left:
            chosen += [b for _, b in members]
            continue
        if tier == (-1, 0) and apart:
            stop_of = dict(block_nodes)
            firsts = [first for first, _ in block_nodes]
            chosen += [b for first in _quantiles(firsts, left // 2, cost, 0, end)
                       for b in (first, stop_of[first]) if 0 < b < end]
        else:
            chosen += _spread(members, left, chosen, cost)
        break
    return sorted(chosen)


CROSS_SLACK = 0.1
"""Cuts of one tier whose crossing bytes are within this share of the cheapest that fill the room are equally
good (a chain's edges carry about the same bytes); among those, the cuts are spread (``_spread``)."""


def _spread(members: list[tuple[int, int]], room: int, chosen: list[int], cost: np.ndarray) -> list[int]:
    """``room`` cuts among ``members`` (``(crossing bytes, position)``): among those crossing about as few
    bytes as the ``room`` cheapest, the ones that split the graph, already cut at ``chosen``, into chunks
    of balanced ``cost`` (cumulative, per position). For a chain of n equal blocks and k chunks: groups of
    n/k consecutive blocks, where ranking by bytes alone would take the first k edges."""
    if room <= 0:
        return []
    ranked = sorted(members)
    threshold = ranked[room - 1][0] * (1 + CROSS_SLACK)
    eligible = sorted(b for cross, b in ranked if cross <= threshold)
    edges = [0, *sorted(chosen), len(cost) - 1]
    spans = []  # (lo, hi, candidates inside)
    for lo, hi in itertools.pairwise(edges):
        inside = eligible[bisect.bisect_right(eligible, lo):bisect.bisect_left(eligible, hi)]
        if inside:
            spans.append((lo, hi, inside))
    shares = _apportion([float(cost[hi] - cost[lo]) for lo, hi, _ in spans], [len(c) for *_, c in spans], room)
    out: list[int] = []
    for (lo, hi, inside), count in zip(spans, shares):
        out += _quantiles(inside, count, cost, lo, hi)
    return out


def _apportion(weights: list[float], caps: list[int], total: int) -> list[int]:
    """``total`` split in proportion to ``weights`` (largest remainders first), none above its cap (the caps
    sum to at least ``total``)."""
    weights = [w + 1e-12 for w in weights]  # a span of no cost still takes cuts once the others are full
    shares = [0] * len(weights)
    left = total
    while left > 0:
        open_ = [i for i in range(len(weights)) if shares[i] < caps[i]]
        mass = sum(weights[i] for i in open_)
        ideal = {i: left * weights[i] / mass for i in open_}
        given = 0
        for i in open_:
            add = min(int(ideal[i]), caps[i] - shares[i])
            shares[i] += add
            given += add
        if given == 0:  # every ideal share below one: the largest remainders get one each
            for i in sorted(open_, key=lambda i: ideal[i], reverse=True)[:left]:
                shares[i] += 1
                given += 1
        left -= given
    return shares


def _quantiles(inside: list[int], count: int, cost: np.ndarray, lo: int, hi: int) -> list[int]:
    """``count`` of the positions ``inside`` (sorted), each the nearest in cost to one of the ``count`` equal
    steps between ``lo`` and ``hi``, in order and distinct."""
    out: list[int] = []
    at = 0
    weights = [float(cost[b]) for b in inside]
    for j in range(1, count + 1):
        target = float(cost[lo]) + j * float(cost[hi] - cost[lo]) / (count + 1)
        last = len(inside) - (count - j)  # leave one position for each cut still to place
        k = bisect.bisect_left(weights, target, at, last)
        if k == last or (k > at and target - weights[k - 1] <= weights[k] - target):
            k -= 1
        k = max(k, at)
        out.append(inside[k])
        at = k + 1
    return out


def _cumulative_cost(profile: Profile, end: int) -> np.ndarray:
    """Per position ``b`` in ``0..end``: the share of the forward's nodes and of the bytes it allocates that
    the nodes before ``b`` account for (``0`` to ``2``): what balanced chunks split evenly. Nodes stand for
    time: measured times would move the cuts from one profile of a model to the next."""
    made = np.zeros(end, dtype=np.float64)
    for storage in profile.storages:
        if 0 <= storage.producer < end:
            made[storage.producer] += storage.nbytes
    per_node = 1.0 / max(1, end) + made / (made.sum() or 1.0)
    return np.concatenate(([0.0], np.cumsum(per_node)))


def _last_use(profile: Profile) -> list[int]:
    last = [s.producer for s in profile.storages]
    for i, node in enumerate(profile.nodes):
        for s in node.inputs:
            last[s] = max(last[s], i)
    return last


def _mutation_spans(profile: Profile) -> list[tuple[int, int]]:
    """``(producer, mutating node)`` for every in-place modification of an activation."""
    return [(profile.storages[s].producer, i) for i, node in enumerate(profile.nodes) for s in node.mutates]
