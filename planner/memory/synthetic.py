"""Hand-made profiles of small graphs (no torch), for testing and benchmarking the solvers against exact references."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from planner.capture.calls import entry_path
from planner.memory.build import build_model
from planner.memory.model import ChunkPlan, MemoryModel
from planner.memory.regions import find_regions
from planner.memory.simulate import simulate
from planner.profiling.record import LOSS_NODE, NodeCost, Profile, StorageCost

PARAM_BYTES = 1000


class GraphBuilder:
    """Builds a synthetic ``Profile`` op by op; per-node memory comes from a replay of the
    un-checkpointed step (saved storages live until their first saver's backward, the rest
    until their last reader; each backward holds its output's gradient and makes its inputs')."""

    def __init__(self, input_bytes: int = 64) -> None:
        self.storages = [StorageCost(nbytes=input_bytes, producer=-1)]  # storage 0: the model input
        self.ops: list[dict] = []

    def op(self, name: str, reads: list[int], sizes: list[int], *, saves: Sequence[int] = (),
           save_outputs: Sequence[int] = (), cost_ms: float = 1.0, scope: tuple[str, ...] = (),
           kernels: Sequence[str] = ()) -> list[int]:
        """Adds a node reading ``reads`` and allocating storages of ``sizes``; it saves the storages
        ``saves`` and its own outputs at positions ``save_outputs``; ``kernels``: the ops it dispatches
        (``NodeCost.kernels``). Returns the new storage ids."""
        index = len(self.ops)
        out = []
        for size in sizes:
            out.append(len(self.storages))
            self.storages.append(StorageCost(nbytes=size, producer=index))
        self.ops.append(dict(name=name, reads=list(reads), out=out, saves=list(saves) + [out[k] for k in save_outputs],
                             cost_ms=cost_ms, scope=scope, kernels=tuple(kernels)))
        return out

    def build(self, loss_reads: list[int]) -> Profile:
        ops = [*self.ops, dict(name=LOSS_NODE, reads=list(loss_reads), out=[], saves=list(loss_reads), cost_ms=0.01,
                               scope=())]
        storages = self.storages
        last_use = {s: max([i for i, o in enumerate(ops) if s in o["reads"]], default=storages[s].producer)
                    for s in range(len(storages))}
        saved_by: dict[int, int] = {}
        for i, o in enumerate(ops):
            for s in o["saves"]:
                saved_by.setdefault(s, i)
        nodes = []
        for i, o in enumerate(ops):
            is_loss = o["name"] == LOSS_NODE
            start_f = PARAM_BYTES + sum(st.nbytes for s, st in enumerate(storages)
                                        if st.producer < i and (s in saved_by or last_use[s] >= i))
            grad_out = 8 if is_loss else storages[o["out"][0]].nbytes if o["out"] else 0
            grad_in = sum(storages[s].nbytes for s in o["reads"] if storages[s].producer >= 0)
            start_b = (PARAM_BYTES + sum(storages[s].nbytes for s, first in saved_by.items() if first <= i)
                       + grad_out)
            nodes.append(NodeCost(
                name=o["name"], kind=LOSS_NODE if is_loss else "call_function", target=o["name"],
                module_path=entry_path(o["scope"][-1]) if o["scope"] else "", scope=o["scope"],
                fwd_ms=o["cost_ms"], bwd_ms=2 * o["cost_ms"], fwd_start_bytes=start_f,
                fwd_peak_bytes=start_f + sum(storages[s].nbytes for s in o["out"]) + 8 * is_loss,
                bwd_start_bytes=start_b, bwd_peak_bytes=start_b + grad_in,
                inputs=tuple(o["reads"]), outputs=tuple(o["out"]), saves=tuple(o["saves"]),
                checkpointable=not is_loss, kernels=o.get("kernels", ()),
            ))
        total_ms = sum(o["cost_ms"] for o in self.ops)
        return Profile(nodes=tuple(nodes), storages=tuple(storages), device="cpu", torch_version="synthetic",
                       input_shapes=(), param_bytes=PARAM_BYTES, grad_bytes=PARAM_BYTES,
                       step_fwd_ms=total_ms, step_bwd_ms=2 * total_ms)


def graph_profile(
    sizes: list[int], costs_ms: list[float], *, saves_input: list[bool], skips: dict[int, int] | None = None,
    internal: list[int] | None = None,
) -> Profile:
    """A graph of ``len(sizes)`` nodes plus the loss.

    Node i reads node i-1's output (and, for ``skips = {i: j}``, node j's output too, saving
    it), allocates an output of ``sizes[i]`` bytes (plus an internal saved tensor of
    ``internal[i]`` bytes when non-zero), and saves its input or its output.
    """
    skips = skips or {}
    internal = internal or [0] * len(sizes)
    graph = GraphBuilder()
    outputs: list[int] = []
    for i, size in enumerate(sizes):
        reads = [outputs[i - 1] if i else 0] + ([outputs[skips[i]]] if i in skips else [])
        made = graph.op(f"n{i}", reads, [size] + ([internal[i]] if internal[i] else []),
                        saves=([reads[0]] if saves_input[i] else []) + reads[1:],
                        save_outputs=([] if saves_input[i] else [0]) + ([1] if internal[i] else []),
                        cost_ms=costs_ms[i])
        outputs.append(made[0])
    return graph.build([outputs[-1]])


MM, BMM, SOFTMAX, GELU = ("aten.mm.default",), ("aten.bmm.default",), ("aten._softmax.default",), ("aten.gelu.default",)
"""The kernels ``transformer_profile``'s nodes name (``NodeCost.kernels``), so that op-level policies read them."""


def transformer_profile(layers: int, *, tokens: int = 1024, width: int = 256, heads: int = 4, seq: int = 128,
                        seed: int = 0) -> Profile:
    """A pre-norm transformer decoder of ``layers`` blocks, 17 nodes each (attention written out:
    scores, mask, softmax, dropout), with float32 sizes for ``tokens`` tokens of ``width`` and
    per-node times drawn around a FLOP-proportional cost."""
    rng = random.Random(seed)
    act, scores = 4 * tokens * width, 4 * heads * tokens * seq

    def ms(base: float) -> float:
        return round(base * rng.uniform(0.9, 1.1), 3)

    graph = GraphBuilder(input_bytes=8 * tokens)
    (x,) = graph.op("embed", [0], [act], cost_ms=ms(0.2), scope=("embed#0",))
    for i in range(layers):
        blk = (f"blocks.{i}#0",)
        att, mlp = (*blk, f"blocks.{i}.attn#0"), (*blk, f"blocks.{i}.mlp#0")
        a, _ = graph.op(f"ln1_{i}", [x], [act, 8 * tokens], saves=[x], save_outputs=[1], cost_ms=ms(0.1), scope=blk)
        (qkv,) = graph.op(f"qkv_{i}", [a], [3 * act], saves=[a], cost_ms=ms(3.0), scope=att, kernels=MM)
        (s1,) = graph.op(f"scores_{i}", [qkv], [scores], saves=[qkv], cost_ms=ms(1.0), scope=att, kernels=BMM)
        (s2,) = graph.op(f"scale_{i}", [s1], [scores], cost_ms=ms(0.3), scope=att)
        (s3,) = graph.op(f"mask_{i}", [s2], [scores], cost_ms=ms(0.3), scope=att)
        (p,) = graph.op(f"softmax_{i}", [s3], [scores], save_outputs=[0], cost_ms=ms(0.6), scope=att, kernels=SOFTMAX)
        d, _ = graph.op(f"attn_drop_{i}", [p], [scores, scores // 4], save_outputs=[1], cost_ms=ms(0.5), scope=att)
        (y,) = graph.op(f"attn_v_{i}", [d, qkv], [act], saves=[d, qkv], cost_ms=ms(1.0), scope=att, kernels=BMM)
        (z,) = graph.op(f"proj_{i}", [y], [act], saves=[y], cost_ms=ms(1.0), scope=att, kernels=MM)
        z2, _ = graph.op(f"resid_drop_{i}", [z], [act, act // 4], save_outputs=[1], cost_ms=ms(0.2), scope=att)
        (x1,) = graph.op(f"add1_{i}", [x, z2], [act], cost_ms=ms(0.1), scope=blk)
        b, _ = graph.op(f"ln2_{i}", [x1], [act, 8 * tokens], saves=[x1], save_outputs=[1], cost_ms=ms(0.1), scope=blk)
        (h,) = graph.op(f"fc_{i}", [b], [4 * act], saves=[b], cost_ms=ms(4.0), scope=mlp, kernels=MM)
        (g,) = graph.op(f"gelu_{i}", [h], [4 * act], saves=[h], cost_ms=ms(0.8), scope=mlp, kernels=GELU)
        (o,) = graph.op(f"fc2_{i}", [g], [act], saves=[g], cost_ms=ms(4.0), scope=mlp, kernels=MM)
        o2, _ = graph.op(f"mlp_drop_{i}", [o], [act, act // 4], save_outputs=[1], cost_ms=ms(0.2), scope=mlp)
        (x,) = graph.op(f"add2_{i}", [x1, o2], [act], cost_ms=ms(0.1), scope=blk)
    (logits,) = graph.op("head", [x], [8 * act], saves=[x], cost_ms=ms(8.0), scope=("head#0",))
    return graph.build([logits])


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
            if not model.regions.allows(k, stop):
                continue
            plans.extend(((k, stop), *rest) for rest in extend(stop))
        return plans

    return extend(0)


@dataclass(frozen=True, slots=True)
class PlanTable:
    """Every plan of a model with its simulated peak and recompute time: brute force, simulated once and then
    asked for any budget."""

    peaks: tuple[int, ...]
    recompute: tuple[int, ...]

    @classmethod
    def of(cls, model: MemoryModel) -> PlanTable:
        timelines = [simulate(model, plan) for plan in all_plans(model)]
        return cls(peaks=tuple(t.peak_bytes for t in timelines), recompute=tuple(t.recompute_us for t in timelines))

    @property
    def min_peak(self) -> int:
        return min(self.peaks)

    def least_recompute(self, budget_bytes: int) -> int | None:
        """Least recompute time (µs) of any plan whose peak fits, or None."""
        fits = [us for peak, us in zip(self.peaks, self.recompute) if peak <= budget_bytes]
        return min(fits) if fits else None


def brute_force(model: MemoryModel, budget_bytes: int) -> int | None:
    """Least recompute time (µs) of any plan whose simulated peak fits, or None."""
    return PlanTable.of(model).least_recompute(budget_bytes)


def min_peak_brute(model: MemoryModel) -> int:
    return PlanTable.of(model).min_peak


__all__ = [
    "PlanTable",
    "all_plans",
    "brute_force",
    "graph_profile",
    "memory_model",
    "min_peak_brute",
    "random_profile",
]
