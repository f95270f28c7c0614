"""The chunk DP (planner.solve.rotor) against brute force on DAGs with skip connections: exact optimum,
exact smallest peak, and a lower bound that never exceeds the optimum."""

import numpy as np
import pytest
from conftest import random_graph

from planner.memory.simulate import simulate
from planner.memory.synthetic import transformer_profile
from planner.solve import chain_dp as chain
from planner.solve.deadline import Deadline
from planner.solve.result import NoSolution
from planner.solve.rotor import relaxed, rotor, smallest_peak

# Graphs of 8 and 9 nodes take 10-50 s each against brute force: the quick run (-m "not slow") skips them.
CASES = [pytest.param(n, seed, skips, marks=pytest.mark.slow if n >= 8 else ())
         for n, seed in [(6, 5), (8, 6), (9, 7), (9, 8)] for skips in (False, True)]


@pytest.mark.parametrize(("n", "seed", "skips"), CASES)
def test_dp_is_exact_on_small_dags(n, seed, skips):
    model, table = random_graph(n, seed, skips)
    lowest, highest = table.min_peak, simulate(model, ()).peak_bytes
    for budget in range(lowest - 1, highest + 1, max(1, (highest - lowest) // 5)):
        expected = table.least_recompute(budget)
        if expected is None:
            assert relaxed(model, budget) is None
            with pytest.raises(NoSolution):
                rotor(model, budget, deadline=Deadline.after(30))
            continue
        found = rotor(model, budget, deadline=Deadline.after(30))
        assert found.recompute_us == expected, f"budget {budget}: plan {found.plan}"
        assert simulate(model, found.plan).peak_bytes <= budget
        assert relaxed(model, budget)[1] == expected


@pytest.mark.parametrize(("n", "seed", "skips"), CASES)
def test_smallest_peak_is_exact(n, seed, skips):
    model, table = random_graph(n, seed, skips)
    plan, exact = smallest_peak(model)
    assert exact
    assert simulate(model, plan).peak_bytes == table.min_peak


@pytest.mark.slow
def test_untracked_storages_keep_plans_feasible_and_bounds_valid(monkeypatch):
    """With at most one storage tracked per boundary, the conservative DP still fits the budget
    and the optimistic one still bounds it from below."""
    monkeypatch.setattr(chain, "MAX_OPEN", 0)
    for seed, skips in [(1, True), (2, True), (3, False)]:
        model, table = random_graph(9, seed, skips)
        lowest, highest = table.min_peak, simulate(model, ()).peak_bytes
        for budget in range(lowest, highest, max(1, (highest - lowest) // 4)):
            expected = table.least_recompute(budget)
            try:
                found = rotor(model, budget, deadline=Deadline.after(30))
            except NoSolution:
                found = None
            if found is not None:
                assert simulate(model, found.plan).peak_bytes <= budget and found.recompute_us >= expected
            lower = relaxed(model, budget)
            assert lower is not None and lower[1] <= expected
        assert not smallest_peak(model)[1] or len(model.varying()) == 0


@pytest.mark.slow
def test_transformer_graph_is_proven_optimal_by_the_dps():
    """On a residual stack every storage is tracked: the two DPs meet (solve needs no CP-SAT)."""
    from planner.memory.build import build_model
    from planner.memory.regions import find_regions
    profile = transformer_profile(12)
    model = build_model(profile, find_regions(profile, max_chunks=128))
    budget = simulate(model, ()).peak_bytes // 2
    found, (_, lower) = rotor(model, budget, deadline=Deadline.after(30)), relaxed(model, budget)
    assert found.recompute_us == lower


def test_more_chunks_never_cost_more_recompute_and_stay_exact(restore_buffers):
    """``max_chunks`` widens the plan space (the cut ranking is fixed, a higher cap adds positions):
    the optimum can only get cheaper, and the finer plan is still exact when measured. One profile
    for both: plan_for refines the coarse chunking itself, so two profiles' timings would be compared."""
    from conftest import assert_plan_is_exact
    from models import tower, tower_inputs

    from planner import plan_for, prepare

    model, inputs = tower(), tower_inputs()
    loss_fn = lambda out: out.square().mean()
    coarse = prepare(model, inputs=inputs, loss_fn=loss_fn, max_chunks=4)
    fine = prepare(model, inputs=inputs, loss_fn=loss_fn, max_chunks=64, profile=coarse.profile)
    assert coarse.regions.n_chunks <= 4 < fine.regions.n_chunks
    budget = fine.baseline.peak_bytes * 6 // 10
    few, many = (plan_for(p, budget, selective=False) for p in (coarse, fine))
    assert many.recompute_ms <= few.recompute_ms and many.solver_status == "OPTIMAL"
    assert_plan_is_exact(model, many, inputs, loss_fn, restore_buffers)
    with pytest.raises(ValueError, match="max_chunks must be an int >= 1"):
        prepare(model, inputs=inputs, max_chunks=0)


@pytest.mark.slow
def test_cli_rejects_a_bad_chunk_cap_in_one_line():
    import subprocess
    import sys
    from pathlib import Path
    example = Path(__file__).resolve().parent.parent / "examples" / "seed_cnn.py"
    bad = subprocess.run([sys.executable, "-m", "planner", str(example), "--max-chunks", "0"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "--max-chunks must be an integer >= 1" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_step_minimum_is_the_pointwise_minimum():
    """The DP's value functions (non-decreasing steps of the kept bytes): ``minimum`` equals the
    pointwise minimum everywhere, shared starts and INF tails included, with no redundant breakpoint."""
    from planner.solve.rotor_step import INF, Step

    rng = np.random.default_rng(0)

    def step(n: int) -> Step:
        starts = np.concatenate(([0], np.sort(rng.choice(np.arange(1, 12), size=n, replace=False))))
        values = np.sort(rng.integers(0, 20, len(starts)))
        if rng.random() < 0.5:
            values[-1] = INF
        return Step(starts.astype(np.int64), values.astype(np.int64))

    for _ in range(500):
        a, b = step(int(rng.integers(0, 6))), step(int(rng.integers(0, 6)))
        low = a.minimum(b)
        grid = np.arange(0, 14)
        assert np.array_equal(low.at(grid), np.minimum(a.at(grid), b.at(grid)))
        assert low.start[0] == 0 and np.all(np.diff(low.start) > 0) and np.all(np.diff(low.value) != 0)
