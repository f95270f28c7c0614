"""No plan within the prepared chunks is not "infeasible": the planner makes the chunks finer itself,
and says whether infeasibility is proven over every cut position or only over those it searched. And
when finer chunks re-run less, it solves them while the time limit allows (refinement)."""


import pytest
import torch
from conftest import assert_plan_is_exact
from rich.console import Console
from torch import nn

import planner.planning.chunkings as solving
from planner import InfeasibleBudget, optimize
from planner.capture.step import default_loss
from planner.options import PlanOptions
from planner.pipeline import plan_for, plan_from_solution, prepare
from planner.report.render import header, infeasible_json
from planner.solve.deadline import Deadline

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


def _coarse(prepared, budget):
    """The plan at the prepared chunks alone (widened only if none fits there), as before refinement."""
    return solving.widen(prepared, budget, PlanOptions(selective=False), Deadline.after(30))


@pytest.mark.parametrize("share", [0.25, 0.5, 0.75])
def test_finer_chunks_are_solved_when_they_re_run_less(peaks, share, restore_buffers, timed_as_users_are):
    """Refinement (``solving.refine``): 4 chunks hold coarse plans; plan_for solves at a finer chunking
    and returns a plan that re-runs less, within the budget, with exact gradients; selective plans
    are solved at the same chunking and never re-run more."""
    model, inputs, _ = peaks
    prepared = prepare(model, inputs=inputs, max_chunks=4)
    lowest = _smallest(model, inputs, 4).min_peak_bytes
    budget = int(lowest + share * (prepared.baseline.peak_bytes - lowest))
    _, coarse = _coarse(prepared, budget)
    plan = plan_for(prepared, budget, selective=False)
    assert coarse.plan and round(plan.recompute_ms * 1000) < coarse.recompute_us
    assert plan.solver_status == "OPTIMAL"
    assert_plan_is_exact(model, plan, inputs, default_loss, restore_buffers)
    assert plan_for(prepared, budget).recompute_ms <= plan.recompute_ms + 1e-9


def test_no_refinement_without_the_time_for_it(peaks, monkeypatch):
    """The time left must cover REFINE_TIME times the next DPs, else the coarse plan stands."""
    model, inputs, _ = peaks
    prepared = prepare(model, inputs=inputs, max_chunks=4)
    lowest = _smallest(model, inputs, 4).min_peak_bytes
    budget = (lowest + prepared.baseline.peak_bytes) // 2
    _, coarse = _coarse(prepared, budget)
    default = solving.REFINE_TIME
    monkeypatch.setattr(solving, "REFINE_TIME", 1e9)
    plan = plan_for(prepared, budget, selective=False)
    assert [s.nodes for s in plan.segments] == [s.nodes for s in plan_from_solution(prepared, coarse, budget).segments]
    assert plan.chunks == 4 and "among 4 chunks" in _plan_line(plan)  # what OPTIMAL and the bound hold over
    monkeypatch.setattr(solving, "REFINE_TIME", default)
    finer = plan_for(prepared, budget, selective=False)
    assert round(finer.recompute_ms * 1000) < coarse.recompute_us  # below the coarse plan's bound
    assert finer.chunks is None or finer.chunks > 4


def _plan_line(plan):
    """The report's "plan" line."""
    console = Console(width=200, record=True)
    console.print(header(plan, model_file="m.py", solver="cpsat"))
    return next(line for line in console.export_text().splitlines() if line.strip().startswith("plan"))


def test_a_budget_at_the_smallest_peak_gets_that_plan_when_the_search_finds_none(peaks, monkeypatch, restore_buffers):
    """Where the strategy finds no plan in time at the chunkings tried, but the smallest peak's plan (what the
    error would name) fits the budget, that plan is returned, FEASIBLE, not an InfeasibleBudget naming the
    budget itself as the smallest peak."""
    model, inputs, _ = peaks
    prepared = prepare(model, inputs=inputs, max_chunks=4)
    lowest = _smallest(model, inputs, 4).min_peak_bytes
    monkeypatch.setattr(solving, "WIDEST_CHUNKS", 4)  # no finer chunking to go to

    def finds_nothing(*args, **kwargs):
        raise solving._NoPlan()

    monkeypatch.setattr(solving, "solve_budget", finds_nothing)
    monkeypatch.setattr(solving, "_every_block", lambda *args: None)  # nor do the placements by hand
    plan = plan_for(prepared, lowest, selective=False)
    assert plan.segments and plan.solver_status == "FEASIBLE" and plan.recompute_bound_ms is None
    assert plan.predicted_peak_bytes <= lowest
    assert_plan_is_exact(model, plan, inputs, default_loss, restore_buffers)
