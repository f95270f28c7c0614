"""The memory model on tiny chains whose memory is worked out by hand, node by node.

Each graph is a profile written out as literal numbers: what an un-checkpointed step holds before
and at the peak of every node's forward and backward, derived in the comments from the storages
alive at that moment. Each case then works out, again by hand, what a real step holds under a plan
(docs/memory-model.md: a segment's inputs are kept, its other activations are re-made by one re-run
just before the backward of its last saving node, and the model's output stays referenced until
backward ends) and checks that ``simulate`` predicts exactly that, at every node. No expected number
comes from the simulator or from the model's formulas.

Units are bytes. ``P`` is what every moment holds: parameters (1000) and the model's input x (64).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from planner.memory.build import build_model
from planner.memory.model import ChunkPlan
from planner.memory.regions import Regions
from planner.memory.simulate import simulate
from planner.profiling.record import LOSS_NODE, NodeCost, Profile, StorageCost

PARAMS = 1000
X = 64
P = PARAMS + X


def node(name: str, *, reads: tuple[int, ...], makes: tuple[int, ...], saves: tuple[int, ...],
         fwd: tuple[int, int], bwd: tuple[int, int]) -> NodeCost:
    """A node with its measured (start, peak) bytes in forward and in backward."""
    loss = name == LOSS_NODE
    return NodeCost(name=name, kind=LOSS_NODE if loss else "call_function", target=name, module_path="", scope=(),
                    fwd_ms=1.0, bwd_ms=2.0, fwd_start_bytes=fwd[0], fwd_peak_bytes=fwd[1],
                    bwd_start_bytes=bwd[0], bwd_peak_bytes=bwd[1], inputs=reads, outputs=makes, saves=saves,
                    checkpointable=not loss)


def profile(nodes: list[NodeCost], sizes: list[int]) -> Profile:
    """Storage 0 is the input x; storage i > 0 has ``sizes[i]`` bytes and is made by node i - 1."""
    storages = (StorageCost(nbytes=X, producer=-1),
                *(StorageCost(nbytes=size, producer=i - 1) for i, size in enumerate(sizes) if i))
    return Profile(nodes=tuple(nodes), storages=storages, device="cpu", torch_version="by hand", input_shapes=(),
                   param_bytes=PARAMS, grad_bytes=PARAMS, step_fwd_ms=4.0, step_bwd_ms=8.0)


def one_chunk_per_node(n_checkpointable: int) -> Regions:
    return Regions(starts=tuple(range(n_checkpointable)), end=n_checkpointable,
                   checkpointable=(True,) * n_checkpointable)


# ── Graph 1: a chain x -> a -> b -> c -> d -> loss ─────────────────────────────────────────────────
#
# storage  bytes  made by  read by  saved by
# s1       100    a        b        b          (b saves its input, like a Linear)
# s2       200    b        c        -          (nobody saves it: freed after c in forward)
# s3       300    c        d        c          (c saves its own output, like a sigmoid)
# s4        50    d        loss     loss       (the model's output: referenced until backward ends)
#
# d saves nothing but its backward uses 500 bytes of workspace; the loss makes an 8-byte scalar and
# its backward starts from an 8-byte gradient. Each backward makes the gradient of what it reads
# (same size), and frees its output's gradient and the tensors it saved when it ends.
#
# Un-checkpointed step, forward (start -> peak):
#   a     P                          = 1064  ->  + s1 100            = 1164
#   b     P + s1                     = 1164  ->  + s2 200            = 1364
#   c     P + s1 + s2                = 1364  ->  + s3 300            = 1664   then s2 dies: 1464
#   d     P + s1 + s3                = 1464  ->  + s4 50             = 1514
#   loss  P + s1 + s3 + s4           = 1514  ->  + scalar 8          = 1522
# backward, in reverse (start -> peak):
#   loss  P + s1 + s3 + s4 + 8       = 1522  ->  + grad s4 50        = 1572   then: 1564
#   d     P + s1 + s3 + s4 + g4 50   = 1564  ->  + g3 300 + ws 500   = 2364   then g4 dies, g3 stays: 1814
#   c     P + s1 + s3 + s4 + g3      = 1814  ->  + g2 200            = 2014   then s3, g3 die: 1414
#   b     P + s1 + s4 + g2           = 1414  ->  + g1 100            = 1514   then s1, g2 die: 1214
#   a     P + s4 + g1                = 1214  ->  (x needs no grad)   = 1214
CHAIN = profile([
    node("a", reads=(0,), makes=(1,), saves=(0,), fwd=(1064, 1164), bwd=(1214, 1214)),
    node("b", reads=(1,), makes=(2,), saves=(1,), fwd=(1164, 1364), bwd=(1414, 1514)),
    node("c", reads=(2,), makes=(3,), saves=(3,), fwd=(1364, 1664), bwd=(1814, 2014)),
    node("d", reads=(3,), makes=(4,), saves=(), fwd=(1464, 1514), bwd=(1564, 2364)),
    node(LOSS_NODE, reads=(4,), makes=(), saves=(4,), fwd=(1514, 1522), bwd=(1522, 1572)),
], sizes=[X, 100, 200, 300, 50])

# ── Graph 2: the model's output is recomputed: x -> a -> b -> c -> loss ──────────────────────────
#
# storage  bytes  made by  read by  saved by
# s1       400    a        b        b
# s2       100    b        c        -          (freed after c in forward)
# s3       100    c        loss     c, loss    (c saves its output, which is the model's output)
#
# Un-checkpointed step, forward:
#   a     P                          = 1064  ->  + s1 400            = 1464
#   b     P + s1                     = 1464  ->  + s2 100            = 1564
#   c     P + s1 + s2                = 1564  ->  + s3 100            = 1664   then s2 dies: 1564
#   loss  P + s1 + s3                = 1564  ->  + scalar 8          = 1572
# backward:
#   loss  P + s1 + s3 + 8            = 1572  ->  + g3 100            = 1672   then: 1664
#   c     P + s1 + s3 + g3           = 1664  ->  + g2 100            = 1764   then g3 dies (s3 is the
#                                                                             output: it stays): 1664
#   b     P + s1 + s3 + g2           = 1664  ->  + g1 400            = 2064   then s1, g2 die: 1564
#   a     P + s3 + g1                = 1564  ->                      = 1564
OUTPUT = profile([
    node("a", reads=(0,), makes=(1,), saves=(0,), fwd=(1064, 1464), bwd=(1564, 1564)),
    node("b", reads=(1,), makes=(2,), saves=(1,), fwd=(1464, 1564), bwd=(1664, 2064)),
    node("c", reads=(2,), makes=(3,), saves=(3,), fwd=(1564, 1664), bwd=(1664, 1764)),
    node(LOSS_NODE, reads=(3,), makes=(), saves=(3,), fwd=(1564, 1572), bwd=(1572, 1672)),
], sizes=[X, 400, 100, 100])


@dataclass(frozen=True)
class Case:
    graph: Profile
    plan: ChunkPlan
    """Segments as chunk ranges; here chunk k is node k."""
    saves: frozenset[int]
    fwd: list[int]
    """Expected bytes at each node's forward peak, in forward order."""
    bwd: list[int]
    """Expected bytes at each node's backward peak (the re-run included), in forward order."""
    peak: int


CASES = {
    # No plan: the prediction is the measured step.
    "chain, no plan": Case(
        CHAIN, (), frozenset(),
        fwd=[1164, 1364, 1664, 1514, 1522],
        bwd=[1214, 1514, 2014, 2364, 1572],
        peak=2364),  # d's backward: P + s1 + s3 + s4 + g4 + g3 + workspace = 1064+100+300+50+50+300+500

    # Segment {b, c}: s1 is its input (kept: b saves it anyway); s2 dies after c as before; s3 is no
    # longer kept for c's backward, so it dies after d, its last reader.
    #   forward   a 1164, b 1364, c 1664 (s2 dies: 1464)
    #             d  P + s1 + s3 = 1464 -> + s4 = 1514              then s3 dies: P + s1 + s4 = 1214
    #             loss 1214 -> + 8 = 1222
    #   backward  loss  P + s1 + s4 + 8 = 1222 -> + g4 = 1272        then 1264
    #             d     P + s1 + s4 + g4 = 1264 -> + g3 + ws = 1264 + 300 + 500 = 2064
    #                   then g4 dies: P + s1 + s4 + g3 = 1514
    #             c's backward unpacks s3: the segment re-runs from s1 just before it:
    #               b again: + s2' 200 = 1714;  c again: + s3' 300 = 2014, packed: early stop;
    #               s2' dies: 1814
    #             c     1814 -> + g2 200 = 2014                      then s3', g3 die: 1414
    #             b     1414 -> + g1 100 = 1514;  a  1214
    # The re-run bump (2014) is the old peak at c; the new peak is d's backward, 300 (s3) lower.
    "chain, segment b..c": Case(
        CHAIN, ((1, 3),), frozenset(),
        fwd=[1164, 1364, 1664, 1514, 1222],
        bwd=[1214, 1514, 2014, 2064, 1272],
        peak=2064),

    # Segment {b, c} saving b (selective checkpointing): SAC caches s2 from b's forward until the
    # re-run asks for it, so s2 lives through d and the loss; the re-run does not run b again.
    #   forward   a 1164, b 1364, c 1664 (s2 stays, cached)
    #             d  P + s1 + s2 + s3 = 1664 -> + s4 = 1714          then s3 dies: 1414
    #             loss 1414 -> + 8 = 1422
    #   backward  loss  P + s1 + s2 + s4 + 8 = 1422 -> + g4 = 1472   then 1464
    #             d     1464 -> + g3 300 + ws 500 = 2264             then g4 dies: 1714
    #             re-run before c: b's output comes from the cache (no new bytes): 1714;
    #               c again: + s3' 300 = 2014, packed: early stop;  s2 dies with the re-run: 1814
    #             c     1814 -> + g2 200 = 2014                      then 1414
    #             b     1414 -> + g1 = 1514;  a  1214
    "chain, segment b..c saving b": Case(
        CHAIN, ((1, 3),), frozenset({1}),
        fwd=[1164, 1364, 1664, 1714, 1422],
        bwd=[1214, 1514, 2014, 2264, 1472],
        peak=2264),

    "output, no plan": Case(
        OUTPUT, (), frozenset(),
        fwd=[1464, 1564, 1664, 1572],
        bwd=[1564, 2064, 1764, 1672],
        peak=2064),

    # Segment {b, c} over the model's output: s1 is kept (input, and saved by b), s2 dies after c as
    # before, and s3 stays alive because the step still references the output. So nothing is freed,
    # and the re-run makes a second copy of the output for c's backward:
    #   forward   unchanged: 1464, 1564, 1664, 1572
    #   backward  loss 1672 (then 1664: P + s1 + s3 + g3)
    #             re-run before c: b again + s2' 100 = 1764; c again + s3' 100 = 1864, packed;
    #               s2' dies: 1764
    #             c     P + s1 + s3 + g3 + s3' = 1764 -> + g2 100 = 1864   then s3', g3 die: 1664
    #             b     1664 -> + g1 400 = 2064;  a  1564
    "output, segment b..c": Case(
        OUTPUT, ((1, 3),), frozenset(),
        fwd=[1464, 1564, 1664, 1572],
        bwd=[1564, 2064, 1864, 1672],
        peak=2064),
}


@pytest.mark.parametrize("name", CASES)
def test_simulated_memory_equals_the_hand_count(name):
    case = CASES[name]
    model = build_model(case.graph, one_chunk_per_node(len(case.graph.nodes) - 1))
    timeline = simulate(model, case.plan, case.saves)
    assert timeline.fwd_bytes.tolist() == case.fwd
    assert timeline.bwd_bytes.tolist() == case.bwd
    assert timeline.peak_bytes == case.peak

