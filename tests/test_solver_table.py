"""Every registered strategy in every budget regime, on one graph whose answers brute force knows:
slack (the un-checkpointed peak fits), binding (between the smallest peak and that), infeasible
(below the smallest peak)."""

import pytest

from planner.memory.build import build_model
from planner.memory.regions import find_regions
from planner.memory.simulate import simulate
from planner.memory.synthetic import all_plans, brute_force, min_peak_brute, transformer_profile
from planner.solve.deadline import Deadline
from planner.solve.registry import SOLVERS
from planner.solve.result import NoSolution, SolverStatus

pytestmark = pytest.mark.slow  # brute force over every plan of 9 chunks

FIXED = {"every_block", "sqrt_n", "none", "op_sac"}
"""Fixed placements: chosen without the budget, nothing proven."""


@pytest.fixture(scope="module")
def model():
    profile = transformer_profile(3, tokens=256, width=64, seq=64)
    return build_model(profile, find_regions(profile, max_chunks=9))


@pytest.fixture(scope="module")
def regimes(model):
    baseline, smallest = simulate(model, ()).peak_bytes, min_peak_brute(model)
    assert smallest < baseline and len(all_plans(model)) > 50
    budgets = {"slack": baseline, "binding": (smallest + baseline) // 2, "infeasible": smallest - 1}
    return {regime: (budget, brute_force(model, budget)) for regime, budget in budgets.items()}


@pytest.mark.parametrize("regime", ["slack", "binding", "infeasible"])
@pytest.mark.parametrize("name", list(SOLVERS))
def test_solver_in_regime(model, regimes, name, regime):
    budget, best = regimes[regime]  # best: least recompute of any plan that fits, or None
    if name in FIXED:
        solution = SOLVERS[name](model, budget, deadline=Deadline.after(5))
        assert solution.status == SolverStatus.FIXED and solution.bound_us is None
        assert solution.recompute_us == simulate(model, solution.plan, solution.saves).recompute_us
        if regime == "infeasible":  # a fixed placement cannot fit where nothing does
            assert simulate(model, solution.plan, solution.saves).peak_bytes > budget
        return
    if regime == "infeasible":
        assert best is None
        with pytest.raises(NoSolution) as info:
            SOLVERS[name](model, budget, deadline=Deadline.after(5))
        assert info.value.infeasible
        return
    solution = SOLVERS[name](model, budget, deadline=Deadline.after(5))
    assert simulate(model, solution.plan, solution.saves).peak_bytes <= budget
    if name == "cpsat":
        assert solution.status == SolverStatus.OPTIMAL and solution.recompute_us == best
        assert solution.bound_us is not None and solution.bound_us <= best
    else:  # rotor: a feasible plan, never cheaper than the optimum
        assert solution.recompute_us >= best
    if regime == "slack":
        assert best == 0 and (name != "cpsat" or solution.recompute_us == 0)


def test_capabilities_describe_every_strategy(model, regimes):
    """Each strategy's declared capabilities match what it does (callers read them, not names)."""
    from planner.solve.registry import CAPABILITIES, capabilities

    assert set(CAPABILITIES) == set(SOLVERS)
    budget, _ = regimes["binding"]
    for name in SOLVERS:
        solution = SOLVERS[name](model, budget, deadline=Deadline.after(5))
        caps = capabilities(name)
        assert (solution.status == SolverStatus.FIXED) == (not caps.reads_budget)
        assert (solution.status == SolverStatus.OPTIMAL) <= caps.proves_optimal
        assert not solution.saves or caps.saves or caps.own_saves
