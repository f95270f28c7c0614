"""What CUDA's caching allocator reserves for a plan's step (``Plan.reserved``), and budgets that bound it.

A plan for a GPU (here a GPU's spec, ``device="h100"``) replays its planned module's step on meta tensors and
that allocation sequence through the allocator's rules (``planner.memory.caching``). The replay is checked
against the same step run for real on this CPU and recorded at the dispatcher: the two sequences give the same
reserve. By default the budget bounds the reserve (``budget_bounds="reserved"``)."""

from __future__ import annotations

import pytest
from conftest import load_example

from planner import InfeasibleBudget, load_plan, plan_for, prepare
from planner.capture.inputs import as_inputs
from planner.memory.caching import simulate_reserved
from planner.profiling.measure import allocation_events, measure_live_peak

MiB = 1 << 20
LIMIT = 30
"""Seconds per solve: the properties below hold for any plan the solver returns."""


@pytest.fixture(scope="module")
def gpt():
    example = load_example("gpt")
    prepared = prepare(example["model"], inputs=example["inputs"], loss_fn=example.get("loss_fn"), device="h100")
    return example, prepared


def test_a_gpu_plans_reserve_is_its_step_replayed_through_the_allocator(gpt):
    """The reserve predicted from the meta replay equals the one the real step's allocations give (this CPU,
    recorded at the dispatcher), added to the plan's predicted peak as the allocator's margin."""
    example, prepared = gpt
    plan = plan_for(prepared, 100 * MiB, budget_bounds="allocated", time_limit_s=LIMIT)
    assert plan.reserved is not None and not plan.reserved.expandable
    inputs = as_inputs(plan.module, example["inputs"])
    real = simulate_reserved(allocation_events(plan.module, inputs, example.get("loss_fn")))
    margin = real.needed_bytes - measure_live_peak(plan.module, inputs, example.get("loss_fn"))
    assert plan.reserved.needed_bytes == plan.predicted_peak_bytes + margin
    assert plan.reserved.needed_bytes <= plan.reserved.roomy_bytes
    assert plan.reserved.needed_bytes > plan.predicted_peak_bytes  # segments of 2 and 20 MiB, blocks rounded


def test_the_budget_bounds_the_reserve_by_default(gpt):
    """At 80 MB the plan that fits what is allocated needs more reserved than the budget; the default plans
    again under a lower target until its reserve fits, and re-runs more for it."""
    _, prepared = gpt
    allocated = plan_for(prepared, "80MB", budget_bounds="allocated", time_limit_s=LIMIT)
    assert allocated.predicted_peak_bytes <= allocated.budget_bytes < allocated.reserved.needed_bytes
    assert "over the budget" in allocated.summary()
    reserved = plan_for(prepared, "80MB", time_limit_s=LIMIT)
    assert reserved.reserved.needed_bytes <= reserved.budget_bytes
    assert reserved.predicted_peak_bytes < allocated.predicted_peak_bytes
    assert reserved.recompute_ms >= allocated.recompute_ms
    assert "reserved:" in reserved.summary() and "over the budget" not in reserved.summary()


@pytest.mark.slow
def test_a_budget_only_what_is_allocated_fits_says_so_and_what_to_pass(gpt):
    """Between the smallest peak allocated and the smallest reserve no plan fits the reserve: the error names
    the reserve the closest plan needs and the option that bounds what is allocated instead."""
    _, prepared = gpt
    with pytest.raises(InfeasibleBudget) as low:
        plan_for(prepared, 10 * MiB, budget_bounds="allocated", time_limit_s=LIMIT)
    floor = low.value.min_peak_bytes
    assert plan_for(prepared, floor, budget_bounds="allocated", time_limit_s=LIMIT).predicted_peak_bytes <= floor
    with pytest.raises(InfeasibleBudget, match="caching allocator reserves it.*budget_bounds='allocated'") as info:
        plan_for(prepared, floor, time_limit_s=LIMIT)
    assert info.value.min_peak_bytes > floor


def test_expandable_segments_are_read_from_the_environment(gpt, monkeypatch):
    _, prepared = gpt
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    plan = plan_for(prepared, "120MB", time_limit_s=LIMIT)
    assert plan.reserved.expandable and plan.reserved.needed_bytes <= plan.budget_bytes


def test_the_reserve_is_saved_with_the_plan_and_absent_on_a_cpu(gpt, tmp_path):
    example, prepared = gpt
    plan = plan_for(prepared, "120MB", time_limit_s=LIMIT)
    plan.save(tmp_path / "plan.json")
    assert load_plan(tmp_path / "plan.json").reserved == plan.reserved
    cpu = prepare(example["model"], inputs=example["inputs"], loss_fn=example.get("loss_fn"))  # measured here
    assert plan_for(cpu, "50%", time_limit_s=LIMIT).reserved is None


def test_the_cli_reports_the_reserve_and_takes_what_the_budget_bounds(capsys):
    """``--budget-bounds allocated`` at 80 MB: the plan allocates within the budget and its JSON gives the reserve
    over it; the default bound keeps the reserve within it."""
    import json

    from conftest import EXAMPLES

    from planner.report.cli import main

    common = [str(EXAMPLES / "gpt.py"), "--device", "h100", "--budget", "80MB", "--time-limit", "10", "--json"]
    assert main([*common, "--budget-bounds", "allocated"]) == 0
    allocated = json.loads(capsys.readouterr().out)
    assert allocated["predicted_peak_bytes"] <= allocated["budget_bytes"] < allocated["reserved"]["needed_bytes"]
    assert main(common) == 0
    reserved = json.loads(capsys.readouterr().out)
    assert reserved["reserved"]["needed_bytes"] <= reserved["budget_bytes"]


def test_a_fixed_placement_is_returned_as_it_is_with_its_reserve(gpt):
    """A placement by hand (``solver="every_block"``) reads no budget: planning it again under a lower target would
    give it back unchanged, so it is returned with its reserve, over the budget or not."""
    _, prepared = gpt
    every = plan_for(prepared, prepared.baseline.peak_bytes, solver="every_block")
    at_its_peak = plan_for(prepared, every.predicted_peak_bytes, solver="every_block")
    assert at_its_peak.segments == every.segments
    assert at_its_peak.reserved.needed_bytes > at_its_peak.budget_bytes  # the 20 MiB segments of a 70 MiB step
