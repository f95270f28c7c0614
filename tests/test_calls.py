"""The module-call index, the one glob matcher, the deadline, and the executor's rules: the pieces every
stage shares, each with one home."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from models import tower, tower_inputs

from planner.capture.calls import CallIndex, is_inside, repeated_blocks
from planner.capture.method import CaptureMethod
from planner.common.patterns import matches
from planner.memory.excess import opened, opened_paths
from planner.pipeline import prepare
from planner.rewrite.executor import ExecutorKind, executor_for
from planner.solve.deadline import Deadline


def test_the_index_of_hand_written_scopes():
    scopes = [(), ("a#0",), ("a#0", "a.b#0"), ("a#0",), ("c#0",), ("a#1",), ("c#0",), ()]
    calls = CallIndex.from_scopes(scopes)
    by_entry = {c.entry: c for c in calls.calls}
    assert [c.entry for c in calls.calls] == ["a#0", "a.b#0", "c#0", "a#1"]
    a, b, c, a1 = (by_entry[e] for e in ("a#0", "a.b#0", "c#0", "a#1"))
    assert (a.path, a.index, a.first, a.last, a.parent, a.contiguous) == ("a", 0, 1, 3, None, True)
    assert (b.first, b.last, calls.calls[b.parent].entry) == (2, 2, "a#0")
    assert (c.first, c.last, c.contiguous) == (4, 6, False)  # a#1 runs between its nodes
    assert (a1.index, calls.times_called("a"), calls.times_called("c")) == (1, 2, 1)
    assert calls.module_path(2) == "a.b" and calls.module_path(0) == "" and calls.paths_around(2) == ("a", "a.b")
    assert calls.common_depth(1, 2) == 1 and calls.common_depth(3, 4) == 0
    assert calls.nodes_by_path(end=5) == {"a": [1, 2, 3], "a.b": [2], "c": [4]}


def test_blocks_and_ancestry():
    assert repeated_blocks(["stem", "layers.0", "layers.0.fc", "layers.1", "head"]) == ("layers.0", "layers.1")
    assert is_inside("blocks.0.fc", ["blocks.0"]) and is_inside("blocks.0", ["blocks.0"])
    assert not is_inside("blocks.01", ["blocks.0"])


@pytest.mark.parametrize(("pattern", "name", "expected"), [
    ("blocks.*", "blocks.3", True), ("blocks.*", "blocks.3.fc1", False),  # one part, not the whole subtree
    ("blocks.*.fc1", "blocks.3.fc1", True), ("**.fc1", "blocks.3.fc1", True), ("**.fc1", "fc1", True),
    ("blocks.**", "blocks", True), ("blocks.[02]", "blocks.2", True), ("blocks.[02]", "blocks.1", False),
    ("*softmax*", "softmax", True), ("*softmax*", "blocks_0_attn_softmax", True),
    ("*softmax*", "torch.nn.functional.softmax", False), ("blocks.*.attn:softmax", "blocks.0.attn:softmax", True),
])
def test_one_glob_meaning(pattern, name, expected):
    assert matches(pattern, name) is expected


def test_a_deadline_reads_its_clock():
    now = [100.0]
    deadline = Deadline.after(5.0, clock=lambda: now[0])
    assert deadline.left_s() == 5.0 and not deadline.passed
    now[0] = 103.0
    assert deadline.within(1.0).at == 104.0 and deadline.within(9.0).at == deadline.at
    now[0] = 106.0
    assert deadline.passed and deadline.left_s() == 0.0


def test_executors_follow_the_capture_tier():
    kinds = {method: executor_for(method).kind for method in CaptureMethod}
    assert kinds == {CaptureMethod.FX: ExecutorKind.GRAPH, CaptureMethod.FX_BLOCKS: ExecutorKind.GRAPH,
                     CaptureMethod.FX_UNITS: ExecutorKind.GRAPH, CaptureMethod.ATEN: ExecutorKind.HOOKS,
                     CaptureMethod.EXPORT: ExecutorKind.HOOKS}


@pytest.fixture(scope="module")
def tower_prepared():
    torch.manual_seed(0)
    return prepare(tower(), inputs=tower_inputs(), max_chunks=12)


def test_what_a_plan_opens_is_one_rule_per_chunk_and_per_node(tower_prepared):
    """``excess.opened`` (per chunk, what the memory model and the solvers use) and ``excess.opened_paths``
    (per node range, what the rewriter uses) agree on every plan of the prepared chunks."""
    memory, profile, regions = tower_prepared.memory, tower_prepared.profile, tower_prepared.regions
    assert tower_prepared.rules.opens_modules and regions.n_chunks >= 6
    paths = ["", *dict.fromkeys(c.path for c in profile.calls.calls if c.first < regions.end)]
    ranges = [(a, b) for a in range(regions.n_chunks) for b in range(a + 1, regions.n_chunks + 1)]
    rng = random.Random(0)
    plans = [()] + [tuple(sorted(rng.sample(ranges, 1))) for _ in range(20)]
    plans += [p for p in (tuple(sorted(rng.sample(ranges, 2))) for _ in range(40)) if p[0][1] <= p[1][0]]
    for plan in plans:
        nodes = [(regions.starts[a], regions.bounds(b - 1)[1]) for a, b in plan]
        per_chunk = {p for p, is_open in itertools.islice(zip(paths, opened(memory, plan)), 1, None) if is_open}
        assert per_chunk == opened_paths(profile.calls, nodes), plan


class _Pair(torch.nn.Module):
    """Two layers with ``contiguous()`` between them (diffusers' ResnetBlock2D calls it on its shortcut's input), and
    a scale the forward applies only once it is set."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.GELU())
        self.b = torch.nn.Linear(256, 32)
        self.scale: float | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x).contiguous()  # already contiguous: hands back its input, runs no op
        if self.scale is not None:
            h = h * self.scale
        return x + self.b(h)


def _pairs() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[_Pair() for _ in range(4)])


def test_a_chain_runs_past_a_call_that_hands_back_its_input_and_stops_at_code_the_capture_did_not_see():
    """Module hooks re-run a chain's members only: code between two members would be skipped by the re-run, so
    the chain refuses to run past it. A call that hands back its own input (``contiguous()`` of a contiguous
    tensor) runs nothing to skip; a multiplication the capture did not see (the forward changed after planning)
    is named in a one-line error at the chain's first run."""
    from planner import enable
    from planner.rewrite.chains import ChainError

    model, x = _pairs(), torch.randn(1024, 32)
    plain = _pairs()
    plain(x).sum().backward()
    plan = enable(model, "50%", inputs=(x,), selective=False, time_limit_s=10)
    assert any({f"{i}.a", f"{i}.b"} <= set(s.chain) for s in plan.segments for i in range(4)), plan.segments
    model(x).sum().backward()
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    changed = _pairs()
    enable(changed, "50%", inputs=(x,), selective=False, time_limit_s=10)
    for pair in changed:
        pair.scale = 2.0  # the code between the members is watched on a chain's first run
    with pytest.raises(ChainError, match=r"mul ran between .*\.a and .*\.b, which the re-run would skip"):
        changed(x).sum().backward()
