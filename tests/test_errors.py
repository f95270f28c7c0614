"""Every bad input gets one clear error naming the problem and the fix; the model is left as it was."""

import re

import pytest
import torch
import torch.nn as nn
from models import tower, tower_inputs

from planner import CaptureError, InfeasibleBudget, ProfileError, optimize


def _state(model):
    return (type(model), sorted(model.__dict__), [m.training for m in model.modules()],
            [p.grad for p in model.parameters()], [b.clone() for b in model.buffers()])


def _assert_unchanged(model, before):
    after = _state(model)
    assert after[:3] == before[:3]
    assert all(g is None for g in after[3])
    for a, b in zip(after[4], before[4]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_missing_inputs_says_to_pass_inputs():
    with pytest.raises(TypeError, match="pass inputs="):
        optimize(tower(), "50%")


def test_example_inputs_attribute_is_used():
    model = tower()
    model.example_inputs = tower_inputs()
    assert optimize(model, "60%").segments


@pytest.mark.parametrize("budget", ["50 percent", "4XB", -3, "0%"])
def test_malformed_budget_fails_before_any_work(budget):
    with pytest.raises(ValueError, match="4GiB"):
        optimize(tower(), budget, inputs=tower_inputs())


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:  # control flow on a tensor value
            return self.fc(x)
        return -self.fc(x)


def test_untraceable_model_names_the_line_and_is_left_unchanged():
    """fx cannot trace a value-dependent branch: the note names the line, and the model is captured
    from one real forward instead; nothing of it changes."""
    model = DataDependent()
    before = _state(model)
    plan = optimize(model, "100%", inputs=(torch.randn(2, 8),))
    assert plan.capture_method == "aten"
    assert re.search(r"test_errors.py:\d+: if x.sum\(\) > 0", plan.capture_notes[0])
    assert "\n" not in plan.capture_notes[0]
    _assert_unchanged(model, before)


def test_a_model_no_tier_captures_names_each_failure(monkeypatch):
    import planner.capture.api as capture_api

    def refuse(*args, **kwargs):
        raise RuntimeError("no real forward here")

    monkeypatch.setattr(capture_api, "aten_graph", refuse)
    monkeypatch.setattr(capture_api, "_opaque_candidates", lambda model: [])
    model = DataDependent()
    before = _state(model)
    with pytest.raises(CaptureError, match=r"test_errors.py:\d+: if x.sum\(\) > 0.*no real forward here") as info:
        optimize(model, "50%", inputs=(torch.randn(2, 8),))
    assert "\n" not in str(info.value)
    _assert_unchanged(model, before)


class WrongShape(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(self.fc1(x))


def test_failing_node_is_named_with_shapes_and_chained():
    model = WrongShape()
    before = _state(model)
    with pytest.raises(ProfileError, match=r"node fc2 .*failed: RuntimeError: .*float32\[2, 16\]") as info:
        optimize(model, "50%", inputs=(torch.randn(2, 8),))
    assert isinstance(info.value.__cause__, RuntimeError)
    _assert_unchanged(model, before)


def test_model_without_trainable_parameters():
    model = tower().requires_grad_(False)
    with pytest.raises(ProfileError, match="no parameter that requires grad"):
        optimize(model, "50%", inputs=tower_inputs())


def test_inputs_on_another_device():
    with pytest.raises(ProfileError, match=r"input is on meta.*\.to\('cpu'\)"):
        optimize(tower(), "50%", inputs=(torch.randn(4, 64, device="meta"),))


def test_infeasible_budget_carries_the_smallest_peak():
    model = tower()
    model.eval()
    before = _state(model)
    with pytest.raises(InfeasibleBudget) as info:
        optimize(model, "1KiB", inputs=tower_inputs())
    err = info.value
    assert err.budget_bytes == 1024 and err.min_peak_bytes > 1024
    assert err.breakdown.parameters_bytes > 0
    assert err.breakdown.total_bytes == err.min_peak_bytes
    assert "raise the budget to at least" in str(err)
    _assert_unchanged(model, before)
    plan = optimize(model, err.min_peak_bytes, inputs=tower_inputs())
    assert plan.predicted_peak_bytes <= err.min_peak_bytes
