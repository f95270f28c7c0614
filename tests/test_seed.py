"""The seed tutorial's mistakes, measured: per-layer checkpoints save almost nothing, and its
flatten bug is reported as a clear error naming the shapes."""

import pytest
import torch
import torch.nn.functional as F
from conftest import load_example
from torch.utils.checkpoint import checkpoint

from planner import InfeasibleBudget, ProfileError, optimize
from planner.capture.inputs import as_inputs
from planner.profiling.measure import measure_peak


class SeedPlacement(torch.nn.Module):
    """The tutorial's placement on the fixed model: every layer in its own checkpoint."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        m = self.model
        x = m.pool(F.relu(checkpoint(m.conv1, x, use_reentrant=False)))
        x = m.pool(F.relu(checkpoint(m.conv2, x, use_reentrant=False)))
        return checkpoint(m.fc, m.pool(x).flatten(1), use_reentrant=False)


def test_per_layer_checkpoints_save_almost_nothing_and_the_plan_does_better():
    example = load_example("seed_cnn")
    model, inputs, loss_fn = example["model"], example["inputs"], example["loss_fn"]
    example_inputs = as_inputs(model, inputs)
    baseline_peak = measure_peak(model, example_inputs, loss_fn)
    seed_peak = measure_peak(SeedPlacement(model), example_inputs, loss_fn)
    assert seed_peak >= 0.95 * baseline_peak, "one layer per segment should free almost nothing"

    with pytest.raises(InfeasibleBudget) as info:
        optimize(model, 1, inputs=inputs, loss_fn=loss_fn)
    plan = optimize(model, info.value.min_peak_bytes, inputs=inputs, loss_fn=loss_fn)
    plan_peak = measure_peak(plan.module, example_inputs, loss_fn)
    assert plan_peak < seed_peak
    assert plan_peak <= plan.budget_bytes


class BuggySeed(torch.nn.Module):
    """The tutorial's model verbatim: view(-1, 64*4*4) on a 64x32x32 map."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 32, 3, 1, 1)
        self.conv2 = torch.nn.Conv2d(32, 64, 3, 1, 1)
        self.fc = torch.nn.Linear(64 * 4 * 4, 10)

    def forward(self, x):
        x = self.conv2(self.conv1(x))
        x = x.view(-1, 64 * 4 * 4)
        return self.fc(x)


def test_flatten_bug_is_reported_with_shapes():
    labels = torch.tensor([1, 2, 3, 4])
    with pytest.raises(ProfileError, match=r"loss_fn.*256.*float32\[256, 10\]"):
        optimize(BuggySeed(), "50%", inputs=(torch.randn(4, 3, 32, 32),),
                 loss_fn=lambda out: F.cross_entropy(out, labels))
