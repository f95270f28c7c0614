"""Host offload in the memory model: which kept activations a plan copies to host memory, when each leaves the
device and comes back, what the host link's queues cost (torch-free; ``docs/offload.md`` derives it).

A storage the plan keeps until backward through ckplan's saved-tensor hooks (saved by a node outside every
segment, or held as a segment's input) can be offloaded: when it is first packed for backward, a copy to host
memory is queued on the device-to-host link; the device storage is freed once that copy is done and the
forward has passed its last use. So can an op output selective checkpointing caches and only its segment
reads: its copy is queued when its node has run, and it is freed once the copy is done and the segment's
forward is over. In backward, storages are reloaded group by group (a group: the offloaded storages whose
first need, an unpack or a cached output's segment re-run, falls in one chunk): the first need of group ``g``
issues the reloads of group ``g + 1``, one group ahead, and waits for its own. A reloaded buffer is device
memory from the moment its reload is issued until the storage's release.

On a link that runs beside compute (a GPU's copy engines) a copy costs nothing while the compute hides it;
a reload that is not done when its group is first unpacked stalls the step by the difference. On a link
that does not (``HostLink.overlaps`` False: a CPU, where the host store is the same memory) every copy is
synchronous and costs its whole time.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.memory.model import NEVER, ChunkPlan, MemoryModel
from planner.memory.release import release_of, segment_starts
from planner.memory.reruns import kept_given, rerun_chunk, segment_recompute_us
from planner.memory.saves import Saves, kept_by_saves

MIN_OFFLOAD_BYTES = 2 * 2**20
"""Smallest storage worth offloading (as Unsloth's layer-input offload): below it a copy's fixed cost and the
pack hook's work outweigh the bytes freed."""


@dataclass(frozen=True, kw_only=True, slots=True)
class HostLink:
    """The link between the device and host memory that offloaded activations cross."""

    d2h_bytes_per_us: float
    """Device-to-host copy rate, bytes per microsecond (= MB/s / 1e0: 1 GB/s is 1000 bytes/us)."""
    h2d_bytes_per_us: float
    """Host-to-device copy rate, bytes per microsecond."""
    overlaps: bool
    """Whether copies run beside compute (a GPU's copy engines on a side stream); False: each copy stalls the
    step for its whole time (a CPU)."""
    source: str = ""
    """Where the rates come from (the device spec's ``host_link_source``, or measured here)."""

    @classmethod
    def from_gb_per_s(cls, d2h: float, h2d: float, *, overlaps: bool, source: str = "") -> HostLink:
        return cls(d2h_bytes_per_us=d2h * 1e3, h2d_bytes_per_us=h2d * 1e3, overlaps=overlaps, source=source)


PINNABLE_SHARE = 0.5
"""Share of a host's memory the offloads of all its ranks may pin, where no ``host_budget`` is given (a modelling
choice, not a datasheet figure): pinned pages cannot be swapped or reclaimed, and the rest of the host's memory
serves the operating system, data loader workers, checkpoint staging and optimizer states offloaded to the host."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Host:
    """The host a rank's offloads go to, as its ranks share it: they copy at once (each forward's copies out, each
    backward's copies back) into one host memory, and pin pages of it."""

    ranks: int
    """Ranks of the job on this host (each with its own device and link)."""
    memory_bytes: int | None
    """The host's memory, bytes; None: unknown."""
    bandwidth_gb_per_s: float | None
    """Peak bandwidth of the host's memory, 10^9 bytes/s; None: unknown (each rank's link is taken as it is)."""
    source: str = ""

    def link(self, link: HostLink) -> HostLink:
        """What ``link`` carries for one rank while every rank of the host copies in the same direction: each
        direction at most an equal share of the host memory's bandwidth."""
        if self.bandwidth_gb_per_s is None:
            return link
        share = self.bandwidth_gb_per_s * 1e3 / self.ranks  # bytes per microsecond
        if share >= min(link.d2h_bytes_per_us, link.h2d_bytes_per_us):
            return link
        return HostLink(d2h_bytes_per_us=min(link.d2h_bytes_per_us, share),
                        h2d_bytes_per_us=min(link.h2d_bytes_per_us, share), overlaps=link.overlaps,
                        source=f"{link.source}; host memory {self.bandwidth_gb_per_s:g} GB/s shared by {self.ranks} "
                               "ranks")

    @property
    def budget_bytes(self) -> int | None:
        """Pinned host memory one rank's offloads may hold by default: ``PINNABLE_SHARE`` of the host's memory
        split equally among its ranks; None where the host's memory is unknown."""
        if self.memory_bytes is None:
            return None
        return int(self.memory_bytes * PINNABLE_SHARE) // self.ranks


@dataclass(frozen=True, kw_only=True, slots=True)
class Offloads:
    """The storages a plan offloads and their schedule (``schedule``)."""

    storages: tuple[int, ...]
    """Offloaded storages, in the order their copies to the host are queued (first packed first)."""
    group: tuple[int, ...]
    """Per storage: its reload group, 0 the first reloaded in backward."""
    gone: tuple[int, ...]
    """Per storage: the first forward node during which it is off the device."""
    trigger: tuple[int, ...]
    """Per storage: the backward node at whose start its reload is issued (it is on the device from then on)."""
    release: tuple[int, ...]
    """Per storage: the backward node that frees it (its earliest holder)."""
    cached: tuple[bool, ...]
    """Per storage: held by selective checkpointing's cache, not by the saved-tensor hooks."""
    exposed_us: int
    """Time the copies add to the step: reloads the backward waits for, or every copy on a link that does not
    overlap compute, plus the marking pass over the forward's ops."""
    d2h_busy_us: int
    """Time the device-to-host link is busy in forward."""
    h2d_busy_us: int
    """Time the host-to-device link is busy in backward."""
    fwd_us: int
    """The forward's compute time the copies to the host run beside."""
    bwd_us: int
    """The backward's compute time (re-runs included) the reloads run beside."""
    link: str = ""
    """Where the link's rates come from, and how the host's ranks share it (``HostLink.source``)."""

    @property
    def n(self) -> int:
        return len(self.storages)


NO_OFFLOADS = Offloads(storages=(), group=(), gone=(), trigger=(), release=(), cached=(), exposed_us=0, d2h_busy_us=0,
                       h2d_busy_us=0, fwd_us=0, bwd_us=0)


def offloaded_bytes(model: MemoryModel, offloads: Offloads) -> int:
    return int(sum(int(model.size[s]) for s in offloads.storages))


@dataclass(frozen=True, slots=True)
class Holding:
    """Where the executor can take each kept storage off the device under one plan, and bring it back."""

    release: np.ndarray
    pack: np.ndarray
    """Per storage: the node after which its copy to the host is queued: the first whose forward packs it
    through the hooks, or the node that makes a cached one (NEVER: neither)."""
    last: np.ndarray
    """Per storage: the last forward node that may read it on the device: its last use, or for a cached one
    the end of its segment's forward (where the executor lets it go)."""
    need: np.ndarray
    """Per storage: the backward node that first needs it back: its first unpack, or for a cached one its
    segment's re-run (-1: none)."""
    cached: np.ndarray
    """Per storage: held by selective checkpointing's cache (the executor frees its bytes in place)."""
    eligible: np.ndarray
    """Per storage: offloadable under the plan (kept through the hooks, or cached and used only inside its
    segment; needed back in backward)."""
    fwd_end: np.ndarray
    """The forward's clock: per node, the compute time up to its end, microseconds."""
    bwd_elapsed: np.ndarray
    """The plan's backward clock: compute time before the k-th node from the end, microseconds (re-runs
    included); the copies run beside it."""
    owner: list[int]
    """Per node: its chunk (``Regions.chunk_of``)."""


def holding(model: MemoryModel, plan: ChunkPlan, saves: Saves = frozenset()) -> Holding:
    """Pack and first-unpack nodes of every storage under ``plan``: a saver outside every segment packs it at
    its node and unpacks it in its backward; a segment holding it as input packs it where the segment starts
    and unpacks it where the segment is re-run; a segment caching it (selective checkpointing) copies it from
    the node that makes it, lets it go where its forward ends and needs it back where it is re-run."""
    start = segment_starts(model, plan)
    owner = model.regions.chunk_of()
    release = release_of(model, plan)
    kept = kept_given(model, release)
    cached, release = kept_by_saves(model, saves, release)
    n_s = len(model.size)
    pack = np.full(n_s, NEVER, dtype=np.int64)
    need = np.full(n_s, -1, dtype=np.int64)
    last_node = model.last_use.astype(np.int64)
    reruns, ends = {}, {}
    for first, stop in plan:
        last = rerun_chunk(model, first, stop)
        reruns[first] = None if last is None else int(model.recompute_at[last])
        ends[first] = model.regions.bounds(stop - 1)[1] - 1
    for s in range(n_s):
        if cached[s]:
            _cached(model, s, start, owner, reruns, ends, pack, need, last_node)
            continue
        if not kept[s]:
            continue
        for u in model.savers[s]:
            if _outside(u, owner, start):
                pack[s] = min(pack[s], u)
                need[s] = max(need[s], u)
        p = model.producer_chunk[s]
        for w in set(model.consumer_chunks[s]):
            first = int(start[w])
            if first > p:
                pack[s] = min(pack[s], model.regions.starts[first])
                rerun = reruns.get(first)
                if rerun is not None:
                    need[s] = max(need[s], rerun)
    eligible = ((kept | cached) & ~model.fwd_fixed & (need >= 0) & (pack < NEVER) & (model.producer >= 0)
                & (release < NEVER))
    bwd = model.bwd_cost_us if len(model.bwd_cost_us) else 2 * model.node_cost_us
    per_node = bwd + _rerun_us(model, plan, saves)
    return Holding(release=release, pack=pack, last=last_node, need=need, cached=cached, eligible=eligible,
                    fwd_end=np.cumsum(model.node_cost_us), bwd_elapsed=np.concatenate([[0], np.cumsum(per_node[::-1])]),
                    owner=owner)


def _cached(model: MemoryModel, s: int, start: np.ndarray, owner: list[int], reruns: dict, ends: dict,
            pack: np.ndarray, need: np.ndarray, last_node: np.ndarray) -> None:
    """Fills in a cached storage: offloadable when its segment is re-run, nothing outside the segment reads it in
    forward, and no saver outside every segment packs it through the hooks as well."""
    p = int(model.producer[s])
    first = int(start[owner[p]]) if 0 <= p < len(owner) and owner[p] >= 0 else -1
    rerun = reruns.get(first)
    if first < 0 or rerun is None or model.last_use[s] > ends[first]:
        return
    if any(_outside(u, owner, start) for u in model.savers[s]):
        return
    pack[s], need[s], last_node[s] = p, rerun, ends[first]


def _outside(u: int, owner: list[int], start: np.ndarray) -> bool:
    """Whether node ``u`` runs outside every segment of the plan (``start``: ``segment_starts``), so that what it
    saves passes through the hooks."""
    return u >= len(owner) or owner[u] < 0 or start[owner[u]] < 0


def candidates(model: MemoryModel, plan: ChunkPlan, saves: Saves = frozenset(), *,
               min_bytes: int = MIN_OFFLOAD_BYTES, held: Holding | None = None) -> np.ndarray:
    """Storages the plan could offload: held through the hooks or in a segment's cache, at least ``min_bytes``,
    produced by a node the executor can find at run time (``MemoryModel.markable``), largest first (``held``: the
    plan's ``holding``, when the caller has it)."""
    held = held or holding(model, plan, saves)
    ok = held.eligible & (model.size >= min_bytes)
    if len(model.markable):
        ok &= model.markable[np.clip(model.producer, 0, None)]
    found = np.flatnonzero(ok)
    return found[np.argsort(-model.size[found], kind="stable")]


def _rerun_us(model: MemoryModel, plan: ChunkPlan, saves: Saves) -> np.ndarray:
    """Per node: forward time re-run just before its backward (the segments whose re-run it triggers)."""
    out = np.zeros(model.n_nodes, dtype=np.int64)
    for first, stop in plan:
        last = rerun_chunk(model, first, stop)
        if last is not None:
            out[model.recompute_at[last]] += segment_recompute_us(model, first, stop, saves)
    return out


def schedule(model: MemoryModel, plan: ChunkPlan, saves: Saves, storages, link: HostLink,
             held: Holding | None = None) -> Offloads | None:
    """The schedule of offloading ``storages`` under ``plan``, or None when a copy to the host cannot finish
    within the forward (the storage would never leave the device)."""
    if not len(storages):
        return NO_OFFLOADS
    held = held or holding(model, plan, saves)
    chosen = [s for _, s in sorted((int(held.pack[s]), int(s)) for s in storages)]
    out = _copies_out(model, held, chosen, link)
    if out is None:
        return None
    gone, d2h_busy, exposed_out = out
    back = _reloads(model, held, chosen, link)
    return Offloads(
        storages=tuple(chosen), group=back.group, gone=tuple(gone), trigger=back.trigger,
        release=tuple(int(held.release[s]) for s in chosen), cached=tuple(bool(held.cached[s]) for s in chosen),
        exposed_us=round(exposed_out + back.exposed) + marking_us(model), d2h_busy_us=round(d2h_busy),
        h2d_busy_us=round(back.busy), fwd_us=int(model.node_cost_us.sum()), bwd_us=back.bwd_us, link=link.source)


def _copies_out(model: MemoryModel, held: Holding, chosen: list[int],
                link: HostLink) -> tuple[list[int], float, float] | None:
    """``(gone, busy, exposed)`` of the copies to the host, queued in pack order: the node each storage is gone
    from, the link's busy time and the time the step waits for it (all of it on a link that does not overlap
    compute); None when a copy ends after the forward."""
    idx = np.asarray(chosen, dtype=np.int64)
    copies = model.size[idx] / link.d2h_bytes_per_us
    busy = float(copies.sum())
    after_last = held.last[idx] + 1
    if not link.overlaps:  # synchronous: each copy is done when its pack returns
        return [int(g) for g in after_last], busy, busy
    # a queue: copy i starts when its pack node's forward ends and copy i - 1 is done, so it ends at
    # max over j <= i of (ready_j + copies j..i), a running maximum over the cumulative copy time
    done = np.cumsum(copies)
    ends = done + np.maximum.accumulate(held.fwd_end[held.pack[idx]] - (done - copies))
    gone = np.maximum(after_last, np.searchsorted(held.fwd_end - model.node_cost_us, ends, side="left"))
    if len(gone) and int(gone.max()) >= model.n_nodes:
        return None
    return [int(g) for g in gone], busy, 0.0


@dataclass(frozen=True, slots=True)
class _Back:
    group: tuple[int, ...]
    trigger: tuple[int, ...]
    busy: float
    exposed: float
    bwd_us: int


def _reloads(model: MemoryModel, held: Holding, chosen: list[int], link: HostLink) -> _Back:
    """The reloads in backward: groups by the chunk of each storage's first unpack, the last chunk's first; the first
    unpack of group g issues g's reloads (if not yet) and g + 1's, and waits for g's, stalling the step while the
    link is behind (every reload stalls it on a link that does not overlap compute)."""
    n, owner = model.n_nodes, held.owner
    need = {s: int(held.need[s]) for s in chosen}
    key = {s: owner[need[s]] if need[s] < len(owner) and owner[need[s]] >= 0 else model.n_chunks for s in chosen}
    keys = sorted(set(key.values()), reverse=True)
    group_of = {k: g for g, k in enumerate(keys)}
    unpack_at = [max(need[s] for s in chosen if key[s] == k) for k in keys]  # each group's first unpack
    group_bytes = [0.0] * len(keys)
    for s in chosen:
        group_bytes[group_of[key[s]]] += float(model.size[s])
    issue_at = [unpack_at[0], *unpack_at[:-1]]  # one group ahead; the first on demand
    elapsed = held.bwd_elapsed
    stall, link_free, busy, exposed = 0.0, 0.0, 0.0, 0.0
    ends: dict[int, float] = {}
    for g, at in enumerate(unpack_at):
        now = float(elapsed[n - 1 - at]) + stall
        for h in (g, g + 1):
            if h >= len(keys) or h in ends:
                continue
            copy = group_bytes[h] / link.h2d_bytes_per_us
            busy += copy
            if link.overlaps:
                link_free = max(link_free, now) + copy
                ends[h] = link_free
            else:
                exposed += copy
                ends[h] = now
        stall += max(0.0, ends[g] - now)
    return _Back(group=tuple(group_of[key[s]] for s in chosen),
                 trigger=tuple(issue_at[group_of[key[s]]] for s in chosen), busy=busy, exposed=exposed + stall,
                 bwd_us=int(elapsed[-1]))


def marking_us(model: MemoryModel) -> int:
    """Time the executor's dispatch mode adds to the forward to find the offloaded ops as they run: half of what
    selective checkpointing's modes cost over every chunk (they run in forward and re-run, this in forward)."""
    return int(model.sac_chunk_us.sum()) // 2 if len(model.sac_chunk_us) else 0


def relief(model: MemoryModel, offloads: Offloads) -> tuple[np.ndarray, np.ndarray]:
    """``(forward, backward)``: per node, the bytes the offloaded storages are off the device that the plan's
    timeline counts as kept."""
    n = model.n_nodes
    fwd = np.zeros(n + 1, dtype=np.int64)
    bwd = np.zeros(n + 1, dtype=np.int64)
    for s, gone, trigger, release in zip(offloads.storages, offloads.gone, offloads.trigger, offloads.release):
        fwd[min(gone, n)] += model.size[s]
        lo = max(trigger + 1, release)
        if lo < n:  # off the device in backward before its reload is issued, i.e. at nodes above the trigger
            bwd[lo] += model.size[s]
    return np.cumsum(fwd)[:n], np.cumsum(bwd)[:n]
