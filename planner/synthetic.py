"""Hand-made profiles of small graphs (no torch), for testing the solver against exact references."""

from __future__ import annotations

import itertools
import random

from planner.costs import LOSS_NODE, NodeCost, Profile, StorageCost
from planner.regions import find_regions
from planner.simulate import ChunkPlan, MemoryModel, build_model, simulate

PARAM_BYTES = 1000


def graph_profile(
    sizes: list[int], costs_ms: list[float], *, saves_input: list[bool], skips: dict[int, int] | None = None,
    internal: list[int] | None = None,
) -> Profile:
    """A graph of ``len(sizes)`` nodes plus the loss.

    Node i reads node i-1's output (and, for ``skips = {i: j}``, node j's output too, saving
    it), allocates an output of ``sizes[i]`` bytes (plus an internal saved tensor of
    ``internal[i]`` bytes when non-zero), and saves its input or its output. Per-node
    peaks come from a plain replay of that un-checkpointed step.
    """
    n = len(sizes)
    skips = skips or {}
    internal = internal or [0] * n
    storages = [StorageCost(nbytes=64, producer=-1)]  # the model input
    out_of, extra_of = [], []
    for i in range(n):
        out_of.append(len(storages))
        storages.append(StorageCost(nbytes=sizes[i], producer=i))
        extra_of.append(None)
        if internal[i]:
            extra_of[i] = len(storages)
            storages.append(StorageCost(nbytes=internal[i], producer=i))
    reads, saves = [], []
    for i in range(n):
        read = [out_of[i - 1] if i else 0] + ([out_of[skips[i]]] if i in skips else [])
        saved = [read[0] if saves_input[i] else out_of[i]] + read[1:]
        if extra_of[i] is not None:
            saved.append(extra_of[i])
        reads.append(read)
        saves.append(saved)
    reads.append([out_of[-1]])
    saves.append([out_of[-1]])
    last_use = {s: max([i for i, r in enumerate(reads) if s in r], default=storages[s].producer)
                for s in range(len(storages))}
    saved_by = {s: min(i for i, sv in enumerate(saves) if s in sv) for sv in saves for s in sv}

    def live_forward(i: int) -> int:
        return PARAM_BYTES + sum(st.nbytes for s, st in enumerate(storages)
                                 if st.producer < i and (s in saved_by or last_use[s] >= i))

    def live_backward(t: int) -> int:
        return PARAM_BYTES + sum(storages[s].nbytes for s, first in saved_by.items() if first <= t)

    nodes = []
    for i in range(n + 1):
        is_loss = i == n
        out = [] if is_loss else [out_of[i]] + ([extra_of[i]] if extra_of[i] is not None else [])
        grad_out = 8 if is_loss else sizes[i]
        grad_in = sizes[i - 1] if 0 < i <= n else 0
        start_f = live_forward(i)
        start_b = live_backward(i) + grad_out
        nodes.append(NodeCost(
            name=LOSS_NODE if is_loss else f"n{i}", kind=LOSS_NODE if is_loss else "call_function",
            target="loss" if is_loss else f"op{i}", module_path="", scope=(),
            fwd_ms=0.01 if is_loss else costs_ms[i], bwd_ms=0.0,
            fwd_start_bytes=start_f, fwd_peak_bytes=start_f + sum(storages[s].nbytes for s in out) + 8 * is_loss,
            bwd_start_bytes=start_b, bwd_peak_bytes=start_b + grad_in,
            inputs=tuple(reads[i]), outputs=tuple(out), saves=tuple(saves[i]), checkpointable=not is_loss,
        ))
    return Profile(nodes=tuple(nodes), storages=tuple(storages), device="cpu", torch_version="synthetic",
                   input_shapes=(), param_bytes=PARAM_BYTES, grad_bytes=PARAM_BYTES,
                   step_fwd_ms=sum(costs_ms), step_bwd_ms=2 * sum(costs_ms))


def random_profile(n: int, seed: int, *, skip_connections: bool = False) -> Profile:
    rng = random.Random(seed)
    skips = {}
    if skip_connections:
        for i in range(3, n):
            if rng.random() < 0.3:
                skips[i] = rng.randrange(0, i - 1)
    return graph_profile(
        sizes=[rng.choice([100, 200, 400, 800, 1600]) for _ in range(n)],
        costs_ms=[rng.choice([0.1, 0.5, 1.0, 3.0, 7.0]) for _ in range(n)],
        saves_input=[rng.random() < 0.6 for _ in range(n)],
        internal=[rng.choice([0, 0, 0, 50, 300]) for _ in range(n)],
        skips=skips,
    )


def memory_model(profile: Profile) -> MemoryModel:
    return build_model(profile, find_regions(profile, max_chunks=len(profile.nodes)))


def all_plans(model: MemoryModel) -> list[ChunkPlan]:
    """Every set of disjoint segments of checkpointable chunks."""
    ok = model.regions.checkpointable
    k_max = model.n_chunks

    def extend(k: int) -> list[tuple]:
        if k >= k_max:
            return [()]
        plans = list(extend(k + 1))
        for stop in range(k + 1, k_max + 1):
            if not ok[stop - 1]:
                break
            plans.extend(((k, stop),) + rest for rest in extend(stop))
        return plans

    return extend(0)


def brute_force(model: MemoryModel, budget_bytes: int) -> int | None:
    """Least recompute time (µs) of any plan whose simulated peak fits, or None."""
    best = None
    for plan in all_plans(model):
        timeline = simulate(model, plan)
        if timeline.peak_bytes <= budget_bytes and (best is None or timeline.recompute_us < best):
            best = timeline.recompute_us
    return best


def min_peak_brute(model: MemoryModel) -> int:
    return min(simulate(model, plan).peak_bytes for plan in all_plans(model))


__all__ = ["graph_profile", "random_profile", "memory_model", "all_plans", "brute_force", "min_peak_brute",
           "itertools"]
