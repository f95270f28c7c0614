"""The budget holds where memory runs out: the allocator. What ops allocate inside themselves (oneDNN's reorders in a
CPU convolution), scalars autograd saves, and the RNG state a checkpoint stashes are predicted, and every peak is
measured there (``planner.profiling.allocator``)."""

import pytest
import torch
import torch.nn as nn
from zoo import ConvNeXt, images, labels_loss

from planner import optimize, prepare
from planner.capture.inputs import as_inputs
from planner.errors import ProfileError
from planner.pipeline import plan_for
from planner.profiling.allocator import AllocatorTrace, uncounted
from planner.profiling.measure import measure_live_peak, measure_peak


@pytest.fixture(scope="module")
def convnext():
    torch.manual_seed(0)
    model, inputs, loss_fn = ConvNeXt(), images(8, 128), labels_loss(8)
    return model, inputs, loss_fn, prepare(model, inputs=inputs, loss_fn=loss_fn)


@pytest.mark.slow
def test_a_convnext_is_predicted_at_the_allocator_plain_and_planned(convnext):
    """The dispatcher misses the convolutions' reorders; the profile reads them, and every plan is predicted at the
    allocator to within 1%, never under, within its budget."""
    model, inputs, loss_fn, prepared = convnext
    example = as_inputs(model, inputs)
    live, allocated = measure_live_peak(model, example, loss_fn), measure_peak(model, example, loss_fn)
    assert live < allocated == prepared.baseline.peak_bytes
    convolutions = [n for n in prepared.profile.nodes if "conv" in n.name]
    assert convolutions and all(n.fwd_hidden_bytes > 0 and n.bwd_hidden_bytes > 0 for n in convolutions)
    for budget in ("70%", "55%"):
        plan = plan_for(prepared, budget)
        measured = measure_peak(plan.module, example, loss_fn)
        assert plan.segments and measured <= plan.budget_bytes, budget
        assert measured <= plan.predicted_peak_bytes <= 1.01 * measured, (budget, measured, plan.predicted_peak_bytes)


def test_only_segments_that_draw_random_numbers_stash_the_rng_state():
    """A checkpoint copies the generator's state for each segment (5056 bytes on a CPU, held until its backward):
    segments without dropout skip it, segments with it are predicted with it, exactly."""
    torch.manual_seed(0)
    width = 64
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Dropout(0.1 * (i % 2)),
                                          nn.Linear(4 * width, width)) for i in range(6)])
    x = torch.randn(1024, width)
    plan = optimize(model, "35%", inputs=(x,))
    assert any(s.random for s in plan.segments) and not all(s.random for s in plan.segments)
    assert "preserve_rng_state = False" in plan.source
    example = as_inputs(model, (x,))
    measured = measure_peak(plan.module, example)
    assert measured <= plan.predicted_peak_bytes <= 1.01 * measured
    torch.manual_seed(1)
    expected = model(x).sum()
    expected.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    plan.module(x).sum().backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))  # the same dropout masks


def test_an_inner_trace_is_seen_by_the_outer_one_and_uncounted_memory_by_neither():
    with AllocatorTrace("cpu") as outer:
        outer.mark()
        a = torch.ones(1000)
        with AllocatorTrace("cpu") as inner:
            inner.mark()
            b = torch.ones(500)
            with uncounted():
                host = torch.ones(10_000)
            del b
        del host
        outer.mark()
        del a
    assert inner.peak_bytes == 2000 and inner.end_bytes == 0
    assert outer.peak_bytes == 6000 and [w.start_bytes for w in outer.windows] == [0, 4000] and outer.end_bytes == 0


def test_a_profiler_running_already_is_one_line():
    from torch.profiler import ProfilerActivity, profile

    running = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with running, pytest.raises(ProfileError, match="outside torch.profiler"), AllocatorTrace("cpu"):
        pass


class SlicedEveryStep(nn.Module):
    """An input embedded once and sliced at each of ``steps`` steps: its gradient is summed from every slice."""

    def __init__(self, width: int = 64, steps: int = 32) -> None:
        super().__init__()
        self.embed, self.cell, self.steps = nn.Embedding(100, width), nn.Linear(2 * width, width), steps

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        h = x[:, 0] * 0
        for t in range(self.steps):
            h = torch.tanh(self.cell(torch.cat([x[:, t], h], dim=1)))
        return h


def test_gradients_summed_from_many_readers_are_predicted_as_a_plain_step_sums_them(tmp_path):
    """Autograd sums a gradient in place where it holds the last reference, which a Python dispatch mode takes from
    it: the profile's storage counts read the sums out of place, above the plain step, and the plain step read at
    the allocator corrects them (below zero: ``NodeCost.bwd_hidden_bytes``), exactly; the profile saves and loads."""
    import planner

    torch.manual_seed(0)
    model, ids = SlicedEveryStep(), torch.randint(0, 100, (64, 32))
    example = as_inputs(model, (ids,))
    prepared = prepare(model, inputs=(ids,))
    live, allocated = measure_live_peak(model, example), measure_peak(model, example)
    assert allocated < live and prepared.baseline.peak_bytes == allocated
    assert any(n.bwd_hidden_bytes < 0 for n in prepared.profile.nodes)
    prepared.profile.save(tmp_path / "profile.json")
    assert planner.load_profile(tmp_path / "profile.json") == prepared.profile
