"""CP-SAT against exact references on small graphs: brute force over every segmentation."""

import dataclasses
import random

import pytest
from conftest import random_graph

from planner.memory.excess import excess_of
from planner.memory.simulate import simulate
from planner.memory.synthetic import PlanTable, all_plans, memory_model, random_profile
from planner.solve.cpsat import search
from planner.solve.deadline import Deadline
from planner.solve.default import solve
from planner.solve.peaks import encoded_peak, min_peak
from planner.solve.result import NoSolution

GRAPHS = [(n, seed, skips) for n, seed in [(6, 0), (8, 1), (9, 2), (10, 3), (10, 4)] for skips in (False, True)]


def cases(slow_from: int) -> list:
    """``GRAPHS``, those of ``slow_from`` nodes or more marked slow: against brute force they take 5-80 s
    each, so the quick run (-m "not slow") keeps the small ones."""
    return [pytest.param(*graph, marks=pytest.mark.slow if graph[0] >= slow_from else ()) for graph in GRAPHS]


@pytest.mark.parametrize("engine", [solve, search], ids=["solve", "cpsat-alone"])
@pytest.mark.parametrize(("n", "seed", "skips"), cases(slow_from=8))
def test_binding_budget_matches_brute_force(n, seed, skips, engine):
    model, table = random_graph(n, seed, skips)
    lowest, highest = table.min_peak, simulate(model, ()).peak_bytes
    for budget in (lowest, (lowest + highest) // 2, highest - 1):
        expected = table.least_recompute(budget)
        solution = engine(model, budget, deadline=Deadline.after(20))
        assert solution.status == "OPTIMAL"
        assert solution.bound_us == expected
        assert solution.recompute_us == expected, f"budget {budget}: plan {solution.plan}"
        assert simulate(model, solution.plan).peak_bytes <= budget


@pytest.mark.parametrize(("n", "seed", "skips"), GRAPHS[:4])
def test_slack_budget_needs_no_checkpointing(n, seed, skips):
    model = memory_model(random_profile(n, seed, skip_connections=skips))
    solution = solve(model, simulate(model, ()).peak_bytes, deadline=Deadline.after(20))
    assert solution.recompute_us == 0 and solution.status == "OPTIMAL"


@pytest.mark.parametrize(("n", "seed", "skips"), cases(slow_from=9))
def test_infeasible_budget_is_proven_and_min_peak_is_exact(n, seed, skips):
    model, table = random_graph(n, seed, skips)
    lowest = table.min_peak
    for engine in (solve, search):
        with pytest.raises(NoSolution) as info:
            engine(model, lowest - 1, deadline=Deadline.after(20))
        assert info.value.infeasible
    assert simulate(model, min_peak(model, deadline=Deadline.after(30))).peak_bytes == lowest


@pytest.mark.parametrize("seed", range(4))
def test_encoding_equals_simulator_on_random_plans(seed):
    model = memory_model(random_profile(9, seed, skip_connections=True))
    rng = random.Random(seed)
    for plan in rng.sample(all_plans(model), 12):
        assert encoded_peak(model, plan, deadline=Deadline.after(30)) == simulate(model, plan).peak_bytes, plan


def _with_eager_locals(n: int, seed: int):
    """A random graph whose nodes sit in modules of three nodes each, with Python locals (eager excess)
    on some of them: fx plans keep those locals only where they leave a module's code alone."""
    profile = random_profile(n, seed, skip_connections=True)
    rng = random.Random(seed)
    nodes = list(profile.nodes)
    for i in range(len(nodes) - 1):  # the loss pseudo-node last
        path = f"m{i // 3}"
        nodes[i] = dataclasses.replace(nodes[i], scope=(f"{path}#0",), module_path=path,
                                       eager_excess_bytes=rng.choice([0, 0, 400, 3000, 12000]))
    model = memory_model(dataclasses.replace(profile, nodes=tuple(nodes)))
    assert model.excess.any() and model.regions.chains is None
    return model


@pytest.mark.parametrize("seed", range(3))
def test_eager_locals_encoding_equals_simulator_and_solvers_are_optimal(seed):
    model = _with_eager_locals(8, seed)
    rng = random.Random(seed)
    assert len({int(excess_of(model, plan).sum()) for plan in all_plans(model)}) > 2  # the plan decides
    for plan in rng.sample(all_plans(model), 12):
        assert encoded_peak(model, plan, deadline=Deadline.after(30)) == simulate(model, plan).peak_bytes, plan
    table = PlanTable.of(model)
    lowest, highest = table.min_peak, simulate(model, ()).peak_bytes
    for budget in (lowest, (lowest + highest) // 2, highest - 1):
        expected = table.least_recompute(budget)
        for engine in (solve, search):
            solution = engine(model, budget, deadline=Deadline.after(20))
            assert solution.status == "OPTIMAL" and solution.recompute_us == expected, (engine, budget)
            assert simulate(model, solution.plan).peak_bytes <= budget
