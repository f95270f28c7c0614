"""CP-SAT against exact references on small graphs: brute force over every segmentation."""

import random

import pytest

from planner.memory.simulate import simulate
from planner.solve.peaks import encoded_peak, min_peak
from planner.solve.result import NoSolution
from planner.solve.cpsat import search
from planner.solve.default import solve
from planner.memory.synthetic import all_plans, brute_force, memory_model, min_peak_brute, random_profile

GRAPHS = [(n, seed, skips) for n, seed in [(6, 0), (8, 1), (9, 2), (10, 3), (10, 4)] for skips in (False, True)]


def cases(slow_from: int) -> list:
    """``GRAPHS``, those of ``slow_from`` nodes or more marked slow: against brute force they take 5-80 s
    each, so the quick run (-m "not slow") keeps the small ones."""
    return [pytest.param(*graph, marks=pytest.mark.slow if graph[0] >= slow_from else ()) for graph in GRAPHS]


@pytest.mark.parametrize("engine", [solve, search], ids=["solve", "cpsat-alone"])
@pytest.mark.parametrize(("n", "seed", "skips"), cases(slow_from=8))
def test_binding_budget_matches_brute_force(n, seed, skips, engine):
    model = memory_model(random_profile(n, seed, skip_connections=skips))
    lowest, highest = min_peak_brute(model), simulate(model, ()).peak_bytes
    for budget in (lowest, (lowest + highest) // 2, highest - 1):
        expected = brute_force(model, budget)
        solution = engine(model, budget, time_limit_s=20)
        assert solution.status == "OPTIMAL"
        assert solution.bound_us == expected
        assert solution.recompute_us == expected, f"budget {budget}: plan {solution.plan}"
        assert simulate(model, solution.plan).peak_bytes <= budget


@pytest.mark.parametrize(("n", "seed", "skips"), GRAPHS[:4])
def test_slack_budget_needs_no_checkpointing(n, seed, skips):
    model = memory_model(random_profile(n, seed, skip_connections=skips))
    solution = solve(model, simulate(model, ()).peak_bytes, time_limit_s=20)
    assert solution.recompute_us == 0 and solution.status == "OPTIMAL"


@pytest.mark.parametrize(("n", "seed", "skips"), cases(slow_from=9))
def test_infeasible_budget_is_proven_and_min_peak_is_exact(n, seed, skips):
    model = memory_model(random_profile(n, seed, skip_connections=skips))
    lowest = min_peak_brute(model)
    for engine in (solve, search):
        with pytest.raises(NoSolution) as info:
            engine(model, lowest - 1, time_limit_s=20)
        assert info.value.infeasible
    assert simulate(model, min_peak(model)).peak_bytes == lowest


@pytest.mark.parametrize("seed", range(4))
def test_encoding_equals_simulator_on_random_plans(seed):
    model = memory_model(random_profile(9, seed, skip_connections=True))
    rng = random.Random(seed)
    for plan in rng.sample(all_plans(model), 12):
        assert encoded_peak(model, plan) == simulate(model, plan).peak_bytes, plan
