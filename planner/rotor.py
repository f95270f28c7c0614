"""Rotor-style dynamic programming over the chunks: optimal for chains under our cost model.

The graph is read as a chain of chunks. A storage whose readers and savers all lie in
its producer's chunk or the next one is *local*: whether the plan keeps it is decided
by those two chunks alone. Any other storage is assumed kept (conservative: the plan
stays within budget, but may recompute more than needed). With only local storages
this DP is exact: it returns the least-recompute plan the CP-SAT model would.

State, left to right: the chunk ``a`` where the next piece starts, whether chunk ``a-1``
is checkpointed, the type the piece at ``a`` will have (decided one step ahead, because
a storage produced at the end of a piece is kept or not depending on the next piece),
and ``M``, the bytes of decided kept storages, in slots of ``quantum`` bytes rounded up.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from planner.simulate import ChunkPlan, MemoryModel, prefix_by, recomputed_from, rerun_bytes, rerun_chunk, simulate
from planner.solve import NoSolution, Solution

INF = np.iinfo(np.int64).max // 4


@dataclass(frozen=True, kw_only=True, slots=True)
class _Local:
    """A storage decided by its producer's chunk ``p`` and the next one."""

    size: int
    p: int
    last_use: int
    release: int
    saved_in_p: bool
    saved_in_next: bool
    read_in_next: bool
    fwd_fixed: bool
    savers: tuple[int, ...]

    @property
    def spans_next(self) -> bool:
        """Whether the next chunk has a say in keeping it."""
        return self.saved_in_next or self.read_in_next

    def kept(self, p_ckpt: bool, next_ckpt: bool, next_starts_segment: bool) -> bool:
        return ((self.saved_in_p and not p_ckpt) or (self.saved_in_next and not next_ckpt)
                or (self.read_in_next and next_ckpt and next_starts_segment))


def rotor(model: MemoryModel, budget_bytes: int, *, time_limit_s: float = 30.0, max_slots: int = 4000) -> Solution:
    """The least-recompute plan under the chain reading of the cost model.

    Raises:
        NoSolution: no plan fits under that reading (``infeasible=True``).
    """
    began = time.perf_counter()
    if budget_bytes < 0:
        raise NoSolution(True, "a negative budget fits no plan")
    plan = _chain_dp(model, budget_bytes, max_slots, optimistic=False)
    if plan is None:
        raise NoSolution(True, "no plan fits the budget under the chain model")
    timeline = simulate(model, plan)
    if timeline.peak_bytes > budget_bytes:
        raise AssertionError(f"rotor plan {plan} simulates to {timeline.peak_bytes} > budget {budget_bytes}")
    return Solution(plan=plan, status="FEASIBLE", recompute_us=timeline.recompute_us, bound_us=0,
                    solve_time_s=time.perf_counter() - began)


def relaxed(model: MemoryModel, budget_bytes: int, *, max_slots: int = 4000) -> tuple[ChunkPlan, int] | None:
    """The optimum of a relaxation of the cost model, and its recompute time (a lower bound).

    Storages that span more than two chunks count as never kept, and kept bytes are rounded
    down, so every plan that fits the real model fits the relaxation: its optimum is a lower
    bound on every plan's recompute time, and when its plan also fits the real model
    (``simulate``), that plan is optimal. None: no plan fits even the relaxation (so none fits).
    """
    if budget_bytes < 0:
        return None
    plan = _chain_dp(model, budget_bytes, max_slots, optimistic=True)
    if plan is None:
        return None
    return plan, int(sum(int(model.chunk_cost_us[a:b].sum()) + model.segment_cost_us for a, b in plan))


def _chain_dp(model: MemoryModel, budget_bytes: int, max_slots: int, *, optimistic: bool) -> ChunkPlan | None:
    locals_, fixed = _classify(model, optimistic)
    n = model.n_nodes
    const_fwd = model.const_fwd + prefix_by(model.last_use + 1, fixed * ~model.fwd_fixed, n)
    kept_fixed = prefix_by(model.release, fixed, n)  # always-kept storages released by t
    const_bwd = model.const_bwd + kept_fixed
    const_bwd -= np.array([int(fixed[list(own)].sum()) if own else 0 for own in model.own_saved], dtype=np.int64)
    sizes = [s.size for s in locals_]
    quantum = max(math.gcd(*sizes) if sizes else 1, math.ceil(budget_bytes / max_slots))
    slots = budget_bytes // quantum + 1
    dp = _ChainDP(model, locals_, const_fwd, const_bwd, kept_fixed, budget_bytes, quantum, slots,
                  round_down=optimistic)
    return dp.run()


def _classify(model: MemoryModel, optimistic: bool) -> tuple[list[_Local], np.ndarray]:
    """Local storages, and the bytes of every storage treated as always kept (non-local storages
    are always kept, or with ``optimistic`` never kept)."""
    fixed = model.size * model.always_kept
    owner = model.regions.chunk_of()
    locals_ = []
    for s in model.varying():
        p = int(model.producer_chunk[s])
        chunks = {p, *model.saver_chunks[s], *model.consumer_chunks[s]}
        if max(chunks) > p + 1 or model.size[s] == 0:
            fixed[s] = 0 if optimistic else model.size[s]
            continue
        savers = {owner[u] for u in model.savers[s] if u < len(owner)}
        locals_.append(_Local(size=int(model.size[s]), p=p, last_use=int(model.last_use[s]),
                              release=int(model.release[s]), saved_in_p=p in savers,
                              saved_in_next=p + 1 in savers, read_in_next=p + 1 in model.consumer_chunks[s],
                              fwd_fixed=bool(model.fwd_fixed[s]), savers=model.savers[s]))
    return locals_, fixed


class _ChainDP:
    def __init__(self, model, locals_, const_fwd, const_bwd, kept_fixed, budget, quantum, slots, *, round_down):
        self.m, self.budget, self.q, self.slots = model, budget, quantum, slots
        self.round_down = round_down
        self.const_fwd, self.const_bwd, self.kept_fixed = const_fwd, const_bwd, kept_fixed
        self.by_chunk: dict[int, list[_Local]] = {}
        for s in locals_:
            self.by_chunk.setdefault(s.p, []).append(s)
        self.recompute_from = recomputed_from(model)
        self._pieces: dict[tuple, tuple[int, int]] = {}

    def piece(self, a: int, b: int, ckpt: bool, prev_ckpt: bool, next_ckpt: bool) -> tuple[int, int]:
        """Largest plan-dependent term of the piece (bytes, M excluded) and the bytes it adds to M."""
        key = (a, b, ckpt, prev_ckpt, next_ckpt)
        if key not in self._pieces:
            self._pieces[key] = self._piece(a, b, ckpt, prev_ckpt, next_ckpt)
        return self._pieces[key]

    def _piece(self, a: int, b: int, ckpt: bool, prev_ckpt: bool, next_ckpt: bool) -> tuple[int, int]:
        m = self.m
        lo, hi = m.regions.starts[a], m.regions.bounds(b - 1)[1]
        alive_f = np.zeros(hi - lo + 1, dtype=np.int64)
        alive_b = np.zeros(hi - lo + 1, dtype=np.int64)
        own_b = np.zeros(hi - lo + 1, dtype=np.int64)  # kept bytes a node saves itself (constant at it)
        added = 0
        involved = [(s, s.kept(prev_ckpt, ckpt, ckpt)) for s in self.by_chunk.get(a - 1, ()) if s.spans_next]
        for k in range(a, b):
            for s in self.by_chunk.get(k, ()):
                if k + 1 < b:
                    involved.append((s, s.kept(ckpt, ckpt, False)))
                else:
                    involved.append((s, s.kept(ckpt, next_ckpt, next_ckpt)))
        for s, kept in involved:
            if not kept:
                continue
            if s.p < b - 1 or not s.spans_next:
                added += s.size
            if s.last_use + 1 < hi and not s.fwd_fixed:
                alive_f[max(s.last_use + 1, lo) - lo] += s.size
            if s.release < hi:
                alive_b[max(s.release, lo) - lo] += s.size
                for u in s.savers:
                    if lo <= u < hi:
                        own_b[u - lo] += s.size
        alive_f, alive_b = np.cumsum(alive_f)[:-1], np.cumsum(alive_b)[:-1]
        worst = int((self.const_fwd[lo:hi] + alive_f).max())
        bwd = self.const_bwd[lo:hi] + alive_b - own_b[:-1]
        if ckpt:
            bwd = bwd + self.recompute_from[a, lo:hi]
            last = rerun_chunk(m, a, b)
            if last is not None:
                t = int(m.recompute_at[last])
                rerun = (m.const_recompute[last] + self.kept_fixed[t] + alive_b[t - lo]
                         + rerun_bytes(m, a, last, b))
                worst = max(worst, int(rerun))
        has = m.has_bwd[lo:hi]
        if has.any():
            worst = max(worst, int(bwd[has].max()))
        return worst, added

    def slots_of(self, nbytes: int) -> int:
        """Kept bytes in slots: rounded up (plans stay within budget) or down (a relaxation)."""
        return nbytes // self.q if self.round_down else -(-nbytes // self.q)

    def run(self) -> ChunkPlan | None:
        m, K, S = self.m, self.m.n_chunks, self.slots
        tail = max(int(self.const_fwd[m.regions.end:].max(initial=0)),
                   int(self.const_bwd[m.regions.end:][m.has_bwd[m.regions.end:]].max(initial=0)))
        slot_bytes = np.arange(S, dtype=np.int64) * self.q
        value = np.full((K + 1, 2, 2, S), INF, dtype=np.int64)
        choice: dict[tuple[int, int, int], list] = {}
        value[K, :, 0, :] = np.where(slot_bytes + tail <= self.budget, 0, INF)
        for a in range(K - 1, -1, -1):
            for prev in (0, 1) if a else (0,):
                for ckpt in (0, 1):
                    ends = [a + 1] if not ckpt else [b for b in range(a + 1, K + 1)
                                                     if all(m.regions.checkpointable[a:b])]
                    best = np.full(S, INF, dtype=np.int64)
                    arg = np.full((S, 2), -1, dtype=np.int64)
                    for b in ends:
                        cost = int(m.chunk_cost_us[a:b].sum()) + m.segment_cost_us if ckpt else 0
                        for nxt in ((0, 1) if b < K else (0,)):
                            worst, added = self.piece(a, b, bool(ckpt), bool(prev), bool(nxt))
                            shift = self.slots_of(added)
                            nxt_value = np.full(S, INF, dtype=np.int64)
                            if shift < S:
                                nxt_value[: S - shift] = value[b, ckpt, nxt, shift:]
                            cand = np.where((slot_bytes + worst <= self.budget) & (nxt_value < INF),
                                            nxt_value + cost, INF)
                            better = cand < best
                            best = np.where(better, cand, best)
                            arg[better] = (b, nxt)
                    value[a, prev, ckpt] = best
                    choice[a, prev, ckpt] = arg
        start = min((0, 1), key=lambda c: value[0, 0, c, 0])
        if value[0, 0, start, 0] >= INF:
            return None
        return self._walk(start, choice)

    def _walk(self, start: int, choice) -> ChunkPlan:
        plan, a, prev, ckpt, slot = [], 0, 0, start, 0
        while a < self.m.n_chunks:
            b, nxt = (int(x) for x in choice[a, prev, ckpt][slot])
            _, added = self.piece(a, b, bool(ckpt), bool(prev), bool(nxt))
            if ckpt:
                plan.append((a, b))
            slot += self.slots_of(added)
            a, prev, ckpt = b, ckpt, nxt
        return tuple(plan)
