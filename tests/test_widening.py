"""No plan within the prepared chunks is not "infeasible": the planner makes the chunks finer itself,
and says whether infeasibility is proven over every cut position or only over those it searched."""

import pytest
import torch
from torch import nn

import planner.solving as solving
from planner import InfeasibleBudget, optimize
from planner.report.render import infeasible_json

pytestmark = pytest.mark.slow  # several profiles and solves: ~30 s


def _deep():
    torch.manual_seed(0)
    layers = [m for _ in range(12) for m in (nn.Linear(64, 64), nn.Tanh())]
    return nn.Sequential(*layers), (torch.randn(256, 64),)


def _smallest(model, inputs, max_chunks):
    with pytest.raises(InfeasibleBudget) as info:
        optimize(model, 1, inputs=inputs, max_chunks=max_chunks, selective=False)
    return info.value


@pytest.fixture(scope="module")
def peaks():
    model, inputs = _deep()
    fine, coarse = _smallest(model, inputs, 256), _smallest(model, inputs, 3)
    assert fine.proven and coarse.proven  # 1 byte is below the parameters and gradients: proven at once
    assert fine.min_peak_bytes < coarse.min_peak_bytes  # finer chunks reach lower peaks
    return model, inputs, fine.min_peak_bytes


def test_a_budget_only_finer_chunks_meet_is_planned(peaks):
    model, inputs, budget = peaks
    plan = optimize(model, budget, inputs=inputs, max_chunks=3, selective=False)
    assert plan.predicted_peak_bytes <= budget
    assert len(plan.segments) > 2  # more segments than 3 chunks could hold


def test_not_found_within_the_widest_search_is_not_called_proven(peaks, monkeypatch):
    model, inputs, budget = peaks
    monkeypatch.setattr(solving, "WIDEST_CHUNKS", 4)
    with pytest.raises(InfeasibleBudget) as info:
        optimize(model, budget, inputs=inputs, max_chunks=2, selective=False)
    exc = info.value
    assert not exc.proven and exc.max_chunks == 4 and "not proven" in str(exc) and "max_chunks=8" in str(exc)
    data = infeasible_json(exc)
    assert data["proven"] is False and data["max_chunks"] == 4
