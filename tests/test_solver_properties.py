"""Properties of every plan CP-SAT returns, on random graphs and costs (hypothesis)."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.memory.simulate import simulate
from planner.memory.synthetic import memory_model, random_profile
from planner.solve.deadline import Deadline
from planner.solve.default import solve
from planner.solve.peaks import min_peak
from planner.solve.result import NoSolution

graphs = st.builds(lambda n, seed, skips: memory_model(random_profile(n, seed, skip_connections=skips)),
                   st.integers(4, 12), st.integers(0, 10_000), st.booleans())
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(model=graphs, fractions=st.lists(st.floats(0.0, 1.0), min_size=2, max_size=4))
def test_plans_fit_and_recompute_grows_as_the_budget_shrinks(model, fractions):
    lowest = simulate(model, min_peak(model, deadline=Deadline.after(30))).peak_bytes
    highest = simulate(model, ()).peak_bytes
    budgets = sorted({int(lowest + f * (highest - lowest)) for f in fractions}, reverse=True)
    previous = -1
    for budget in budgets:
        solution = solve(model, budget, deadline=Deadline.after(20))
        assert solution.status == "OPTIMAL"
        assert simulate(model, solution.plan).peak_bytes <= budget
        assert solution.recompute_us >= previous, "a smaller budget never costs less recompute"
        previous = solution.recompute_us


@SETTINGS
@given(model=graphs, below=st.integers(1, 10_000))
def test_budgets_below_the_smallest_peak_are_reported_infeasible(model, below):
    lowest = simulate(model, min_peak(model, deadline=Deadline.after(30))).peak_bytes
    try:
        solution = solve(model, lowest - below, deadline=Deadline.after(20))
    except NoSolution as exc:
        assert exc.infeasible
    else:
        raise AssertionError(f"plan {solution.plan} returned for a budget below the smallest peak")
