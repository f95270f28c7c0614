"""Long chains, the textbook case of checkpointing: hundreds of blocks, loops unrolled over hundreds of steps.

The cuts cover the whole chain in balanced groups; a module called in a loop gives the blocks (its calls, under
hooks each call a segment of its own); a chain of more blocks than the chunkings searched still gets the plans
people place by hand. The models run with default options at the peak a hand placement measures, and must
measure at or under it with the un-checkpointed model's gradients."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_plan_is_exact
from torch import nn

from planner import optimize
from planner.capture.inputs import as_inputs
from planner.capture.step import default_loss
from planner.memory.chains import find_chains
from planner.memory.regions import find_blocks, find_regions
from planner.memory.rules import SegmentRules
from planner.memory.synthetic import GraphBuilder
from planner.profiling.measure import measure_peak

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from long_chains import Hand, Residual, example_module

# -- where the cuts go (hand-made profiles) --------------------------------------------------------------------


def _chain(blocks: int):
    graph = GraphBuilder()
    x = 0
    for i in range(blocks):
        scope = (f"blocks.{i}#0",)
        h = graph.op(f"fc1_{i}", [x], [400], saves=[x], scope=scope)[0]
        a = graph.op(f"act_{i}", [h], [400], save_outputs=[0], scope=scope)[0]
        x = graph.op(f"fc2_{i}", [a], [100], saves=[a], scope=scope)[0]
    return graph.build([x])


def _loop(steps: int):
    """A cell called ``steps`` times, the loop's own code (a slice of the input) before each call."""
    graph = GraphBuilder()
    h = 0
    for t in range(steps):
        x = graph.op(f"select_{t}", [0], [8], scope=())[0]
        h = graph.op(f"cell_{t}", [x, h], [300], saves=[x, h], scope=(f"cell#{t}",))[0]
    return graph.build([h])


def _sizes(starts, edges):
    """How many blocks each chunk holds (chunk starts among the block ``edges``)."""
    at = [edges.index(s) for s in starts]
    return [b - a for a, b in itertools.pairwise([*at, len(edges) - 1])]


def test_a_chain_of_equal_blocks_is_cut_into_equal_groups():
    """120 blocks in 12 chunks: groups of 10 consecutive blocks, where ranking cuts by bytes alone took the
    first 11 block edges and left 109 blocks in one chunk."""
    profile = _chain(120)
    names, ranges = find_blocks(profile, len(profile.nodes) - 1)
    assert len(names) == 120
    regions = find_regions(profile, max_chunks=12)
    edges = [first for first, _ in ranges] + [ranges[-1][1]]
    assert set(regions.starts) <= set(edges)
    assert _sizes(regions.starts, edges) == [10] * 12
    assert regions.block_count == 120 and regions.capped and not regions.blocks  # too few chunks for every block


def test_a_module_called_in_a_loop_gives_the_blocks():
    """The calls of one cell, with the loop's code before each: the steps are its blocks, balanced as numbered
    blocks are. Under module hooks a step is its call alone, and both edges of a call are cut together (a call is
    a segment only then)."""
    profile = _loop(64)
    end = len(profile.nodes) - 1
    names, ranges = find_blocks(profile, end)
    assert names == tuple(f"cell#{t}" for t in range(64))
    assert ranges[1] == (2, 4)  # the slice before call 1, then the call: one step
    regions = find_regions(profile, max_chunks=8)
    assert _sizes(regions.starts, [0] + [hi for _, hi in ranges]) == [8] * 8

    rules = SegmentRules(spans=tuple(find_chains(profile.calls, end)), opens_modules=False)
    assert {span.members for span in rules.spans} == {(f"cell#{t}",) for t in range(64)}
    hooks = find_regions(profile, max_chunks=17, rules=rules)
    calls = [(k, k + 1) for k in range(hooks.n_chunks) if hooks.chains and (k, k + 1) in hooks.chains]
    assert len(calls) == 8  # 16 cuts: both edges of 8 calls, spread over the loop
    every = find_regions(profile, max_chunks=hooks.block_cuts + 1, rules=rules)
    assert len(every.blocks) == 64 and all(every.allows(*block) for block in every.blocks)


# -- real chains, planned at a hand placement's peak -----------------------------------------------------------


def _hand_peak(hand: nn.Module, inputs, loss_fn=default_loss) -> int:
    return measure_peak(hand, as_inputs(hand, inputs), loss_fn)


def _planned_at(model, inputs, peak, restore_buffers, loss_fn=default_loss, **options):
    plan = optimize(model, peak, inputs=inputs, loss_fn=loss_fn, **options)
    assert_plan_is_exact(model, plan, inputs, loss_fn, restore_buffers)  # measured <= peak, exact gradients
    return plan


@pytest.mark.slow
def test_a_thousand_blocks_fit_checkpoint_sequentials_peak(restore_buffers):
    torch.manual_seed(0)
    blocks = nn.Sequential(*[Residual(16) for _ in range(1000)])
    inputs = (torch.randn(256, 16),)
    peak = _hand_peak(Hand(blocks, 32), inputs)  # checkpoint_sequential
    plan = _planned_at(blocks, inputs, peak, restore_buffers)
    assert len(plan.segments) >= 8


@pytest.mark.slow
def test_every_block_checkpointed_is_found_past_the_widest_chunking(restore_buffers):
    """300 blocks checkpointed one by one need a cut at each of 301 block edges, more than the chunkings searched
    (at most 256), and wide blocks (16 KiB across an edge, 512 KiB inside) leave no coarser plan that fits."""
    torch.manual_seed(0)
    blocks = nn.Sequential(*[Residual(16, expand=16) for _ in range(300)])
    inputs = (torch.randn(256, 16),)
    peak = _hand_peak(Hand(blocks, 0), inputs)  # every block
    plan = _planned_at(blocks, inputs, peak, restore_buffers)
    assert len(plan.segments) > 40 and plan.solver_status == "FEASIBLE"  # nothing proven past the chunkings searched


def _rnn_at_hand_peak(kind: str, groups: int):
    """examples/rnn.py's network ``kind`` over 256 steps, its inputs, and the measured peak of ``groups`` steps per
    checkpoint by hand."""
    torch.manual_seed(0)
    model = getattr(example_module("rnn"), kind)(vocab=64, width=32, steps=256)
    inputs = (torch.randint(0, 64, (16, 256)),)
    model.hand_groups = groups
    peak = _hand_peak(model, inputs)
    model.hand_groups = 0
    return model, inputs, peak


@pytest.mark.slow
def test_an_unrolled_rnn_fits_its_hand_groups_peak(restore_buffers):
    """examples/rnn.py's LSTM over 256 steps (torch.fx unrolls the loop), at the peak of groups of 16 steps
    checkpointed by hand, within a 10 s search."""
    model, inputs, peak = _rnn_at_hand_peak("UnrolledRNN", 16)
    _planned_at(model, inputs, peak, restore_buffers, time_limit_s=10)  # nothing is proven on this chain, so the
    # search runs to its limit (30 s by default); what it holds at 10 s fits


@pytest.mark.slow
def test_each_call_of_a_looped_module_is_checkpointed_by_its_index(restore_buffers):
    """The same RNN where torch.fx fails: recorded eagerly, run by module hooks, every call of the cell its own
    segment (``cell#7``), at the peak of every call checkpointed by hand."""
    model, inputs, peak = _rnn_at_hand_peak("EagerRNN", 1)
    plan = _planned_at(model, inputs, peak, restore_buffers)
    assert plan.segments and all(len(s.chain) == 1 and s.chain[0].startswith("cell#") for s in plan.segments)


@pytest.mark.slow
def test_a_loop_that_hands_on_only_its_state_fits_every_calls_peak(restore_buffers):
    """An ``nn.LSTMCell`` over 512 steps (a step of about a second here) whose loop keeps only ``(h, c)`` and
    classifies from the last ``h``, torch.fx kept out: at the measured peak of every call checkpointed by hand, with
    default options. Each step slices the
    embedded input, so its gradient is summed 512 times; autograd sums in place where it holds the last reference,
    which a Python dispatch mode takes from it, so the profile reads those sums at the allocator in a step with no
    mode (without it, no plan fits this budget)."""
    torch.manual_seed(0)
    model = example_module("rnn").StateRNN(vocab=500, width=128, steps=512)
    ids = torch.randint(0, 500, (64, 512))
    targets = torch.randint(0, 500, (64,))
    loss_fn = lambda out: nn.functional.cross_entropy(out, targets)
    model.hand = True
    peak = _hand_peak(model, (ids,), loss_fn)
    model.hand = False
    plan = _planned_at(model, (ids,), peak, restore_buffers, loss_fn)
    assert plan.segments and all(s.chain[0].startswith("cell#") for s in plan.segments)


class SharedBlock(nn.Module):
    """One block applied ``n`` times, nothing between its calls; ``torch.zeros(x.shape[0], ...)`` keeps torch.fx out."""

    def __init__(self, width: int, n: int) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(width, 4 * width), nn.Tanh(), nn.Linear(4 * width, width))
        self.n = n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + torch.zeros(x.shape[0], x.shape[1])
        for _ in range(self.n):
            x = self.block(x)
        return x


@pytest.mark.slow
def test_runs_of_consecutive_calls_of_a_shared_block_are_segments(restore_buffers):
    """Under module hooks, consecutive calls of one module with no code between them form chains (``block#6``
    to ``block#39``), re-run as a whole in backward."""
    torch.manual_seed(0)
    model = SharedBlock(32, 64)
    inputs = (torch.randn(256, 32),)
    plan = optimize(model, "50%", inputs=inputs)
    assert_plan_is_exact(model, plan, inputs, default_loss, restore_buffers)
    assert any(len(s.chain) > 1 and all(m.startswith("block#") for m in s.chain) for s in plan.segments)
