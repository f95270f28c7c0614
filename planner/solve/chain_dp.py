"""The chunk DP's machinery (``ChainDP``): pieces, open-storage flags, value functions of the kept bytes.

The strategies built on it (``rotor``, ``rotor_saves``, ``relaxed``, ``smallest_peak``) are in
``planner.solve.rotor``, whose docstring describes the method.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from planner.memory.model import ChunkPlan, MemoryModel, prefix_by
from planner.memory.saves import NEVER, rerun_parts
from planner.memory.simulate import recomputed_from, rerun_bytes, rerun_chunk, segment_recompute_us
from planner.solve.deadline import Deadline
from planner.solve.result import Failure, NoSolution
from planner.solve.rotor_saves import SaveTable, Variant
from planner.solve.rotor_step import INF, Step

MAX_OPEN = 6
"""Most storages tracked across one chunk boundary (the DP's state grows as 2 ** open)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class _Storage:
    size: int
    producer: int
    chunk: int
    last_use: int
    fwd_fixed: bool
    fixed: int
    """A saver no plan checkpoints (``NEVER`` if none)."""
    savers: tuple[int, ...]
    saver_firsts: dict[int, int]
    """Checkpointable saver chunk -> its first saver of this storage."""
    consumer_chunks: tuple[int, ...]

    def held_in(self, a: int, b: int, ckpt: bool, lo: int, hi: int) -> int | None:
        """Node at which piece ``[a, b)`` (nodes ``[lo, hi)``) holds this storage, None if it does not:
        a segment holds its inputs from its first node, a chunk left alone from its first saver."""
        if ckpt:
            return lo if self.chunk < a and self.read_in(a, b) else None
        at = min(self.fixed if lo <= self.fixed < hi else NEVER, self.saver_firsts.get(a, NEVER))
        return at if at < NEVER else None

    def read_in(self, a: int, b: int) -> bool:
        i = bisect.bisect_left(self.consumer_chunks, a)
        return i < len(self.consumer_chunks) and self.consumer_chunks[i] < b


def _plan_dependent(model: MemoryModel) -> list[int]:
    """Storages whose keeping or release depends on the plan."""
    varying = set(model.varying().tolist())
    return [s for s in range(len(model.size)) if model.size[s] > 0 and (
        s in varying or (model.always_kept[s] and (model.consumer_chunks[s] or model.saver_firsts[s])))]


def _storages(model: MemoryModel) -> dict[int, _Storage]:
    return {s: _Storage(size=int(model.size[s]), producer=int(model.producer[s]),
                        chunk=int(model.producer_chunk[s]), last_use=int(model.last_use[s]),
                        fwd_fixed=bool(model.fwd_fixed[s]), fixed=int(model.fixed_release[s]),
                        savers=model.savers[s], saver_firsts=dict(model.saver_firsts[s]),
                        consumer_chunks=model.consumer_chunks[s])
            for s in _plan_dependent(model)}


def _open_sets(storages: dict[int, _Storage], edges: list[int]) -> list[list[int]]:
    """Per chunk boundary (node ``edges[c]``): storages produced before it and read after it (every
    holder reads the storage, so the plan after the boundary can still hold it)."""
    opened: list[list[int]] = [[] for _ in edges]
    for s, (lo, hi) in _boundaries(storages, edges).items():
        for c in range(lo, hi):
            opened[c].append(s)
    return opened


def _boundaries(storages: dict[int, _Storage], edges: list[int]) -> dict[int, tuple[int, int]]:
    """Per storage, the range ``[lo, hi)`` of the boundaries it is open across (``edges`` ascending)."""
    return {s: (bisect.bisect_right(edges, st.producer), bisect.bisect_right(edges, st.last_use))
            for s, st in storages.items()}


def _untrack(storages: dict[int, _Storage], edges: list[int]) -> dict[int, _Storage]:
    """``storages`` less the longest-lived ones, until at most ``MAX_OPEN`` are open across any boundary: the
    longest-lived first, each only while it is open across a boundary that still has too many (linear in the
    storages: a chain whose every step's output is read at its end has hundreds open at once)."""
    spans = _boundaries(storages, edges)
    count = np.zeros(len(edges) + 1, dtype=np.int64)
    for lo, hi in spans.values():
        count[lo] += 1
        count[hi] -= 1
    count = np.cumsum(count)[:len(edges)]
    if count.max(initial=0) <= MAX_OPEN:
        return storages
    kept = dict(storages)
    for s in sorted(storages, key=lambda s: storages[s].producer - storages[s].last_use):  # longest first
        lo, hi = spans[s]
        if hi > lo and count[lo:hi].max() > MAX_OPEN:
            del kept[s]
            count[lo:hi] -= 1
    return kept


class ChainDP:
    """One run of the chunk DP for a budget: ``optimistic`` reads untracked storages as the relaxation
    does, else conservatively; ``candidates`` adds each segment's save variants (``rotor_saves``)."""

    def __init__(self, model: MemoryModel, budget: int, *, optimistic: bool, candidates: tuple[int, ...] = (),
                 deadline: Deadline | None = None):
        self.m, self.budget, self.optimistic, self.candidates = model, budget, optimistic, candidates
        self.deadline = deadline  # past it run() and fits() give up (None: never)
        n, regions = model.n_nodes, model.regions
        self.edges = [*regions.starts, regions.end]
        tracked = _storages(model)
        every = len(tracked)
        tracked = _untrack(tracked, self.edges)
        opened = _open_sets(tracked, self.edges)
        self.tracked, self.opened = tracked, opened
        # then both readings are the cost model itself (the modules' eager locals that the plan decides,
        # planner.memory.excess, are counted everywhere by the conservative one, nowhere by the other)
        self.exact = len(tracked) == every and not model.excess.any()
        self.open_pos = [{s: i for i, s in enumerate(c)} for c in opened]
        self.made_in = [[s for s, st in tracked.items() if st.chunk == k] for k in range(model.n_chunks)]
        # Untracked storages: kept from their earliest possible release (conservative), or only when
        # no plan can free them, from their latest one (optimistic).
        fixed = model.size * model.always_kept
        if optimistic:
            fixed_at = np.where(model.always_kept, model.fixed_release, model.release)
        else:
            fixed_at = model.release
            fixed = fixed + model.size * np.isin(np.arange(len(model.size)), model.varying())
        fixed[list(tracked)] = 0
        self.const_fwd = model.const_fwd + prefix_by(model.last_use + 1, fixed * ~model.fwd_fixed, n)
        if not optimistic and len(model.excess):
            self.const_fwd = self.const_fwd + model.excess
        self.kept_fixed = prefix_by(fixed_at, fixed, n)
        own_fixed = np.array([sum(int(fixed[x]) for x in own if fixed_at[x] <= t)
                              for t, own in enumerate(model.own_saved)], dtype=np.int64)
        self.const_bwd = model.const_bwd + self.kept_fixed - own_fixed
        self.recompute_from = recomputed_from(model)
        self._pieces: dict[tuple, tuple[int, int, int]] = {}
        self._reruns: dict[tuple, tuple[int, int] | None] = {}
        self._variants: dict[tuple[int, int], list[Variant]] = {}
        self.untracked = {int(s) for s in model.varying()} - set(tracked)
        self._table: SaveTable | None = None
        self._rerun_parts: dict[tuple[int, int], tuple] = {}
        self._floors: dict[int, np.ndarray] = {}

    def variants(self, a: int, b: int) -> list[Variant]:
        """Save variants of segment ``[a, b)`` (just "no saves" without candidates)."""
        if (a, b) not in self._variants:
            if self._table is None:
                self._table = SaveTable(self.m, self.candidates, self.untracked)
            self._variants[a, b] = self._table.variants(a, b)
        return self._variants[a, b]

    def piece(self, a: int, b: int, ckpt: bool, mask: int, v: int = 0) -> tuple[int, int, int]:
        """Worst plan-dependent bytes of piece ``[a, b)`` (``M`` excluded), bytes it closes into ``M``,
        and the flags at ``b``. ``v``: the segment's save variant."""
        key = (a, b, ckpt, mask, v)
        if key not in self._pieces:
            self._pieces[key] = self._piece(a, b, ckpt, mask, self.variants(a, b)[v] if v else None)
        return self._pieces[key]

    def _piece(self, a: int, b: int, ckpt: bool, mask: int, variant: Variant | None) -> tuple[int, int, int]:
        m, lo, hi = self.m, self.edges[a], self.edges[b]
        since: dict[int, int] = {}  # held storage -> first node of the piece whose backward holds it
        for i, s in enumerate(self.opened[a]):
            at = lo if mask >> i & 1 else self.tracked[s].held_in(a, b, ckpt, lo, hi)
            if at is not None:
                since[s] = at
        for s in () if ckpt else self.made_in[a]:  # a segment never holds what it produces
            at = self.tracked[s].held_in(a, b, ckpt, lo, hi)
            if at is not None:
                since[s] = at
        alive_f = np.zeros(hi - lo + 1, dtype=np.int64)
        alive_b = np.zeros(hi - lo + 1, dtype=np.int64)
        own_b = np.zeros(hi - lo + 1, dtype=np.int64)  # kept bytes a node saves itself (in its constant)
        held = self._saves(variant, a, b, since, alive_f, alive_b) if variant is not None else 0
        added = held
        after = self.open_pos[b] if b < len(self.open_pos) else {}
        for s, at in since.items():
            st = self.tracked[s]
            if s not in after and not (self.optimistic and st.fwd_fixed):
                added += st.size
            if st.last_use + 1 < hi and not st.fwd_fixed:
                alive_f[max(st.last_use + 1, lo) - lo] += st.size
            alive_b[at - lo] += st.size
            for u in st.savers:
                if at <= u < hi:
                    own_b[u - lo] += st.size
        alive_f, alive_b = np.cumsum(alive_f)[:-1], np.cumsum(alive_b)[:-1]
        worst = int((self.const_fwd[lo:hi] + alive_f).max())
        bwd = self.const_bwd[lo:hi] + alive_b - own_b[:-1]
        if ckpt:
            bwd = bwd + self.recompute_from[a, lo:hi] - (variant.relief if variant is not None else 0)
        has = m.has_bwd[lo:hi]
        if has.any():
            worst = max(worst, int(bwd[has].max()))
        rerun = self._rerun(a, b, variant) if ckpt and worst <= self.budget else None  # (costly; moot past budget)
        if rerun is not None:
            t, fixed_bytes = rerun
            worst = max(worst, fixed_bytes + int(alive_b[t - lo]) + held)
        out = sum(1 << i for s, i in after.items() if s in since)
        return worst, added, out

    def _saves(self, variant: Variant, a: int, b: int, since: dict, alive_f: np.ndarray, alive_b: np.ndarray) -> int:
        """Applies a save variant to segment ``[a, b)``: the cached storages some node saves are kept,
        held from their first saver; those nobody saves are held by SAC's cache until the re-run (no
        later segment reads them: ``SaveTable.variants``), their bytes added to the piece's forward
        after their last reader and to its backward after the re-run point. Returns the held bytes."""
        m, lo, hi = self.m, self.edges[a], self.edges[b]
        t_r = int(m.recompute_at[rerun_chunk(m, a, b)])
        for s in variant.kept:  # (a first saver after the segment holds it in its own piece)
            if s in self.tracked and m.first_saver[s] < hi:
                since[s] = min(since.get(s, NEVER), int(m.first_saver[s]))
        held = 0
        for s in variant.held:
            size = int(m.size[s])
            held += size
            if m.last_use[s] + 1 < hi:
                alive_f[max(int(m.last_use[s]) + 1, lo) - lo] += size
            alive_b[t_r + 1 - lo] += size
        return held

    def _rerun(self, a: int, b: int, variant: Variant | None) -> tuple[int, int] | None:
        """Node at which segment ``[a, b)`` is re-run, and its plan-independent bytes there (with the
        variant's saves: its cached storages are in the kept sum, not in the replay)."""
        saves = variant.saves if variant is not None else frozenset()
        key = (a, b, saves)
        if key not in self._reruns:
            m, last = self.m, rerun_chunk(self.m, a, b)
            if last is None:
                self._reruns[key] = None
            elif not saves:
                t = int(m.recompute_at[last])
                self._reruns[key] = (t, int(m.const_recompute[last] + self.kept_fixed[t]) + rerun_bytes(m, a, last, b))
            else:  # the replay of every candidate of the segment once, then each variant's reliefs
                if (a, b) not in self._rerun_parts:
                    inside = {o for v in self.variants(a, b) for o in v.saves}
                    self._rerun_parts[a, b] = rerun_parts(m, a, last, b, sorted(inside))
                base, relief, restored = self._rerun_parts[a, b]
                t = int(m.recompute_at[last])
                replay = base - sum(relief[o] for o in saves if o in relief)
                peak = int(m.const_recompute[last] + self.kept_fixed[t]) + int(replay.max()) + restored
                self._reruns[key] = (t, peak)
        return self._reruns[key]

    def _tail(self, *, closing: bool) -> int:
        """Bytes after the last chunk (the loss, the output's backward), M excluded; with
        ``closing``, plus the storages still open at the end counted as kept."""
        m, end = self.m, self.m.regions.end
        tail = max(int(self.const_fwd[end:].max(initial=0)), int(self.const_bwd[end:][m.has_bwd[end:]].max(initial=0)))
        return tail + (sum(self.tracked[s].size for s in self.opened[m.n_chunks]) if closing else 0)

    def run(self) -> tuple[ChunkPlan, frozenset] | None:
        """The best plan and its saves, or None when no plan fits."""
        if self.m.step_bytes > self.budget:  # the optimizer's step, after every plan's backward
            return None
        K = self.m.n_chunks
        end = Step.upto(self.budget - self._tail(closing=not self.optimistic), 0)
        self.value: list[dict[int, Step]] = [{} for _ in range(K)] + [
            dict.fromkeys(range(1 << len(self.opened[K])), end)]
        self.least = [INF] * K + [int(end.value[0])]  # per chunk: its smallest value over flags and M
        for a in range(K - 1, -1, -1):
            self._check_time()
            for mask in range(1 << len(self.opened[a])):
                best = Step.upto(-1, 0)

                def promising(b: int, cost: int, floor: int) -> np.bool_:  # can segment [a, b) beat best anywhere?
                    return cost + self.least[b] < best.at(self.budget - floor)  # noqa: B023 - best as it is now

                for cost, worst, added, b, out, _ in self._moves(a, mask, promising):
                    cap, after = self.budget - worst, self.value[b][out]
                    if cap < 0 or cost + after.value[0] >= best.at(cap):
                        continue  # nowhere better than the best move so far (values grow with M)
                    best = best.minimum(after.shifted(added, cap=cap, plus=cost))
                self.value[a][mask] = best
            self.least[a] = min(int(v.value[0]) for v in self.value[a].values())
        if self.value[0][0].at(0) >= INF:
            return None
        return self._walk()

    def _check_time(self) -> None:
        """Raises NoSolution (not infeasible) once the deadline has passed: checked once per chunk, about
        1/K of a run (60 ms of 16 s at 256 chunks on a 2700-node model)."""
        if self.deadline is not None and self.deadline.passed:
            raise NoSolution(Failure.OUT_OF_TIME, f"the time limit ran out in the chunk DP ({self.m.n_chunks} "
                             "chunks); raise time_limit_s")

    def _moves(self, a: int, mask: int, promising=None):
        """Every piece starting at chunk a allowed by the flags ``mask``: (cost, worst bytes, bytes
        closed into M, end chunk, flags at the end, checkpointed). ``promising(b, least cost, least
        bytes)``: False skips segment ``[a, b)`` before its bytes are computed."""
        m = self.m
        floor, lo = self._floor(a), self.edges[a]
        pieces = [(a + 1, False)] + [(b, True) for b in range(a + 1, m.n_chunks + 1) if m.regions.allows(a, b)]
        for b, ckpt in pieces:
            least_bytes = int(floor[self.edges[b] - 1 - lo])
            if ckpt and least_bytes > self.budget:
                break  # this segment and every longer one from a are over the budget
            cost = segment_recompute_us(m, a, b) if ckpt else 0
            if ckpt and promising is not None and not promising(b, cost - self._spared(a, b), least_bytes):
                continue
            kinds = list(enumerate(self.variants(a, b))) if ckpt and self.candidates else [(0, None)]
            plain = self.piece(a, b, ckpt, mask)
            for v, variant in kinds:
                if v and plain[0] > self.budget:
                    break  # saves never lower a piece's bytes
                worst, added, out = self.piece(a, b, ckpt, mask, v)
                yield cost - (variant.spared_us if variant else 0), worst, added, b, out, (ckpt, v)

    def _spared(self, a: int, b: int) -> int:
        """The most recompute a save variant of segment ``[a, b)`` spares (0 without candidates)."""
        return max((v.spared_us for v in self.variants(a, b)), default=0) if self.candidates else 0

    def _floor(self, a: int) -> np.ndarray:
        """Segments from chunk ``a``: at node ``lo + i``, a lower bound on the worst bytes of every segment
        ``[a, b)`` ending after that node, under any flags and save variant (``_piece``'s constants; what
        a piece holds only adds, and saves never lower its bytes). Non-decreasing in the segment's end."""
        if a not in self._floors:
            lo, end = self.edges[a], self.edges[-1]
            bwd = np.where(self.m.has_bwd[lo:end], self.const_bwd[lo:end] + self.recompute_from[a, lo:end], -INF)
            self._floors[a] = np.maximum(np.maximum.accumulate(self.const_fwd[lo:end]), np.maximum.accumulate(bwd))
        return self._floors[a]

    def fits(self, budget: int) -> ChunkPlan | None:
        """Some plan whose peak is at most ``budget`` (<= the DP's own budget), or None."""
        if self.m.step_bytes > budget:
            return None
        K = self.m.n_chunks
        reach: list[dict[int, tuple[int, tuple]]] = [{} for _ in range(K + 1)]
        reach[0][0] = (0, ())
        for a in range(K):
            self._check_time()
            for mask, (kept, plan) in reach[a].items():
                for _, worst, added, b, out, (ckpt, _) in self._moves(a, mask):
                    if kept + worst <= budget and kept + added < reach[b].get(out, (INF,))[0]:
                        reach[b][out] = (kept + added, (*plan, (a, b)) if ckpt else plan)
        tail = self._tail(closing=True)
        done = [plan for kept, plan in reach[K].values() if kept + tail <= budget]
        return done[0] if done else None

    def _walk(self) -> tuple[ChunkPlan, frozenset]:
        plan, saves, a, mask, kept = [], set(), 0, 0, 0
        while a < self.m.n_chunks:
            target = self.value[a][mask].at(kept)
            for cost, worst, added, b, out, (ckpt, v) in self._moves(a, mask):  # noqa: B007 - read after the break
                if kept + worst <= self.budget and cost + self.value[b][out].at(kept + added) == target:
                    break
            else:
                raise AssertionError(f"no move reproduces the DP value at chunk {a}")
            if ckpt:
                plan.append((a, b))
                saves |= self.variants(a, b)[v].saves
            a, mask, kept = b, out, kept + added
        return tuple(plan), frozenset(saves)
