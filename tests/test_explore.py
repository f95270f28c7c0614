"""sweep() and Tradeoff: rows, guarantees, Pareto front and knee, block view, HTML, pandas and plots."""

from __future__ import annotations

import dataclasses

import matplotlib
import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

matplotlib.use("Agg")

from models import tower, tower_inputs

import planner
from planner.pipeline import plan_for
from planner.plan_file import load_plan
from planner.report import explore
from planner.report.explore import Tradeoff, TradeoffRow, knee_index, monotone, pareto_front, sweep

BUDGETS = ["100%", "90%", "70%", "50%", "20%", 10**9]


@pytest.fixture(scope="module")
def prepared():
    model = tower()
    return planner.prepare(model, inputs=tower_inputs())


@pytest.fixture(scope="module")
def tradeoff(prepared) -> Tradeoff:
    return sweep(prepared.model, BUDGETS, profile=prepared, time_limit_s=10)


def check_guarantees(rows) -> None:
    """Overhead never decreases as the budget decreases; every feasible peak fits its budget."""
    budgets = [r.budget_bytes for r in rows]
    assert budgets == sorted(budgets, reverse=True)
    previous = 0.0
    for row in rows:
        if not row.feasible:
            previous = float("inf")  # below an infeasible budget, nothing is feasible either
            continue
        assert row.predicted_peak_bytes <= row.budget_bytes
        assert row.plan.predicted_peak_bytes <= row.budget_bytes == row.plan.budget_bytes
        assert row.predicted_overhead >= previous
        previous = row.predicted_overhead


def assert_png(path) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    image = matplotlib.image.imread(path)
    assert image.std() > 0  # something was drawn


# rows ----------------------------------------------------------------------------------------


def test_one_row_per_budget_largest_first(tradeoff, prepared):
    rows = tradeoff.rows
    baseline = prepared.baseline.peak_bytes
    assert len(rows) == len(BUDGETS)
    assert [r.budget_bytes for r in rows] == sorted((planner.parse_budget(b, baseline_peak_bytes=baseline)
                                                     for b in BUDGETS), reverse=True)
    assert {f.name for f in dataclasses.fields(TradeoffRow)} == {
        "budget_bytes", "feasible", "predicted_peak_bytes", "predicted_overhead", "n_segments", "solve_time_s", "plan"}
    for row in rows[:2]:  # 1 GB and 100%: the empty plan
        assert row.feasible and row.n_segments == 0 and row.predicted_overhead == 0.0
        assert row.predicted_peak_bytes == baseline
    feasible = [row for row in rows if row.feasible and row.n_segments]
    assert feasible
    row = feasible[len(feasible) // 2]  # a sweep row is what planning that budget alone gives
    alone = planner.plan_for(prepared, row.budget_bytes)
    assert row.n_segments == len(row.plan.segments) and row.plan.module is not None
    assert alone.predicted_peak_bytes <= row.budget_bytes and row.predicted_peak_bytes <= row.budget_bytes
    if row.plan.solver_status == alone.solver_status == "OPTIMAL":  # equal optima (ties may differ in segments)
        assert row.predicted_overhead == pytest.approx(alone.predicted_overhead, rel=1e-9)
    assert tradeoff.baseline_peak_bytes == baseline and tradeoff.step_ms == prepared.profile.step_ms


def test_infeasible_budget_is_a_row(tradeoff):
    last = tradeoff.rows[-1]  # 20% of the tower is below every plan
    assert not last.feasible
    assert (last.plan, last.predicted_peak_bytes, last.predicted_overhead, last.n_segments) == (None,) * 4
    assert last.solve_time_s > 0
    assert tradeoff.min_peak_bytes is not None and tradeoff.min_peak_bytes > last.budget_bytes
    assert any(r.feasible and r.n_segments > 0 for r in tradeoff.rows)


def test_guarantees_hold_on_the_sweep(tradeoff):
    check_guarantees(tradeoff.rows)


@pytest.mark.parametrize("budgets", [  # the first two take 5-15 s each: the quick run keeps the last
    pytest.param(["95%", "85%", "75%", "65%", "55%", "45%"], id="ladder", marks=pytest.mark.slow),
    pytest.param(["60%", "61%", "62%"], id="close", marks=pytest.mark.slow),
    pytest.param(["40%", "100%", "42%", "80%"], id="unsorted")])
def test_guarantees_on_budget_sets(prepared, budgets):
    check_guarantees(sweep(prepared.model, budgets, profile=prepared, time_limit_s=10).rows)


@pytest.mark.slow
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(percents=st.lists(st.integers(min_value=25, max_value=100), min_size=2, max_size=4, unique=True))
def test_guarantees_property(prepared, percents):
    check_guarantees(sweep(prepared.model, [f"{p}%" for p in percents], profile=prepared, time_limit_s=10).rows)


def _fake_row(plan, budget_bytes, *, overhead=None, feasible=True) -> TradeoffRow:
    if not feasible:
        return TradeoffRow(budget_bytes=budget_bytes, feasible=False, predicted_peak_bytes=None,
                           predicted_overhead=None, n_segments=None, solve_time_s=1.0, plan=None)
    if overhead is not None:  # a worse plan, as a solver stopped at its time limit would return
        plan = dataclasses.replace(plan, predicted_overhead=overhead, solver_status="FEASIBLE")
    return explore._row(plan, budget_bytes, 1.0)


def test_monotone_gives_a_larger_budget_the_cheaper_plan_of_a_smaller_one(tradeoff):
    small = next(r for r in reversed(tradeoff.rows) if r.feasible and r.n_segments > 0)
    larger = small.budget_bytes + 1000
    rows = [_fake_row(small.plan, larger + 1000, feasible=False),  # e.g. min_peak stopped at its time limit
            _fake_row(small.plan, larger, overhead=small.predicted_overhead + 0.5),
            _fake_row(small.plan, small.budget_bytes)]
    fixed = monotone(rows)
    for row in fixed[:2]:
        assert row.feasible and row.predicted_overhead == small.predicted_overhead
        assert row.plan.budget_bytes == row.budget_bytes and row.plan.segments == small.plan.segments
        assert row.plan.module is small.plan.module and row.solve_time_s == 1.0
    assert fixed[2] == rows[2]
    check_guarantees(fixed)


def test_monotone_keeps_rows_that_already_hold(tradeoff):
    assert monotone(tradeoff.rows) == tradeoff.rows


# profile= and errors ---------------------------------------------------------------------------


def test_profile_skips_capture_and_profile(prepared, monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("prepare() must not run when profile= is given")

    monkeypatch.setattr(explore, "prepare", fail)
    result = sweep(prepared.model, ["100%", "60%"], profile=prepared, time_limit_s=10)
    assert result.prepared is prepared and len(result.rows) == 2


def test_whole_segment_sweep_plans_without_saves(prepared, monkeypatch):
    """selective=False reaches plan_for for every budget; each row is the whole-segment plan of its budget."""
    asked = []

    def recording(*args, **kwargs):
        asked.append(kwargs["options"].selective)
        return plan_for(*args, **kwargs)

    monkeypatch.setattr(explore, "plan_for", recording)
    result = sweep(prepared.model, ["70%", "50%"], profile=prepared, time_limit_s=10, selective=False)
    assert asked == [False, False]
    for row in result.rows:
        assert row.plan.recompute_ms == plan_for(prepared, row.budget_bytes, selective=False).recompute_ms
        assert not any(s.saved_nodes for s in row.plan.segments)


def test_sweep_without_profile_prepares_the_model():
    model = tower(seed=3)
    result = planner.sweep(model, ["100%", "70%"], inputs=tower_inputs(), time_limit_s=10)
    assert result.prepared.model is model and result.rows[1].n_segments > 0
    check_guarantees(result.rows)


@pytest.mark.parametrize("profile", ["profile.json", {"nodes": []}], ids=["path", "dict"])
def test_profile_must_be_prepared(prepared, profile):
    with pytest.raises(TypeError, match="Prepared.*or a Profile"):
        sweep(prepared.model, ["60%"], profile=profile)


def test_profile_of_another_model_or_with_inputs_is_rejected(prepared):
    with pytest.raises(ValueError, match="another model"):
        sweep(tower(), ["60%"], profile=prepared)
    with pytest.raises(ValueError, match="planner.prepare"):
        sweep(prepared.model, ["60%"], profile=prepared, inputs=tower_inputs())


@pytest.mark.parametrize(("kwargs", "match"), [({"budgets": []}, "at least one budget"),
                                               ({"budgets": ["60%", "lots"]}, "not understood"),
                                               ({"budgets": ["60%"], "solver": "magic"}, "unknown solver")])
def test_bad_arguments_fail_before_any_work(monkeypatch, kwargs, match):
    monkeypatch.setattr(explore, "prepare", lambda *a, **k: pytest.fail("prepared before checking arguments"))
    with pytest.raises(ValueError, match=match):
        sweep(tower(), inputs=tower_inputs(), **kwargs)


def test_exported_from_planner():
    assert planner.sweep is sweep and planner.Tradeoff is Tradeoff
    assert {"sweep", "Tradeoff"} <= set(planner.__all__)


# reference points, Pareto front, knee ----------------------------------------------------------


def test_reference_points(tradeoff, prepared):
    refs = {r.name: r for r in tradeoff.references}
    assert list(refs) == ["none", "every block", "√n"]
    assert refs["none"].predicted_peak_bytes == prepared.baseline.peak_bytes and refs["none"].predicted_overhead == 0
    assert refs["every block"].n_segments == len(prepared.regions.blocks)
    assert refs["every block"].predicted_overhead > 0 and refs["every block"].predicted_peak_bytes < \
        prepared.baseline.peak_bytes


@pytest.mark.parametrize(("points", "front"), [
    ([], []),
    ([(5, 0.0)], [0]),
    ([(5, 0.0), (5, 0.0)], [0]),                                  # duplicates count once
    ([(5, 0.0), (3, 0.2), (4, 0.3), (2, 0.5)], [3, 1, 0]),        # (4, 0.3) is beaten by (3, 0.2)
    ([(3, 0.2), (3, 0.1), (4, 0.1)], [1]),                        # same memory: the cheaper one
])
def test_pareto_front(points, front):
    assert pareto_front(points) == front


@pytest.mark.parametrize(("front", "knee"), [
    ([(1, 1.0), (2, 0.5)], None),                                 # two points: no knee
    ([(0, 1.0), (1, 0.5), (2, 0.0)], None),                       # straight line: no knee
    ([(0, 1.0), (1, 0.9), (2, 0.0)], None),                       # bends the wrong way (above the chord)
    ([(0, 1.0), (1, 0.2), (2, 0.1), (4, 0.0)], 1),                # sharp bend at memory 1
    ([(0, 10.0), (10, 2.0), (50, 1.0), (100, 0.0)], 1),           # axes are normalised first
])
def test_knee_index(front, knee):
    assert knee_index(front) == knee


def test_front_and_knee_of_the_sweep(tradeoff):
    front = tradeoff.front()
    peaks = [r.predicted_peak_bytes for r in front]
    assert peaks == sorted(peaks) and len(set(peaks)) == len(peaks)
    assert all(r.feasible for r in front) and front[-1].predicted_overhead == 0.0
    knee = tradeoff.knee()
    assert knee is None or knee in front[1:-1]


# blocks, pandas, HTML ------------------------------------------------------------------------


def test_blocks_table(tradeoff, prepared):
    table = tradeoff.blocks_table()
    paths = list(prepared.regions.block_paths)
    assert [list(entry) for entry in table] == [["budget_bytes", *paths]] * len(tradeoff.rows)
    index = prepared.profile.node_index()
    for entry, row in zip(table, tradeoff.rows):
        assert entry["budget_bytes"] == row.budget_bytes
        if not row.feasible:
            assert all(entry[p] is None for p in paths)
            continue
        checkpointed = {index[n] for s in row.plan.segments for n in s.nodes}
        for path, (first, stop) in zip(paths, prepared.regions.blocks):
            lo, hi = prepared.regions.starts[first], prepared.regions.bounds(stop - 1)[1]
            assert entry[path] == pytest.approx(len(checkpointed & set(range(lo, hi))) / (hi - lo))
            assert 0.0 <= entry[path] <= 1.0
    assert all(entry[p] == 0.0 for p in paths for entry in table[:2])  # the empty plan
    assert any(entry[p] > 0 for p in paths for entry in table)


class Flat(nn.Module):
    """No container of numbered blocks: the block view falls back to chunks."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(64, 256), nn.Linear(256, 256), nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def test_model_without_blocks_uses_chunks(tmp_path):
    torch.manual_seed(0)
    result = sweep(Flat(), ["100%", "70%"], inputs=(torch.randn(256, 64),), time_limit_s=10)
    assert [r.name for r in result.references] == ["none", "√n"]  # every_block needs blocks
    columns = [c for c in result.blocks_table()[0] if c != "budget_bytes"]
    assert columns == [f"chunk {k}" for k in range(result.prepared.regions.n_chunks)] and columns
    result.plot_blocks().savefig(tmp_path / "chunks.png")
    assert_png(tmp_path / "chunks.png")


def test_to_pandas(tradeoff):
    pd = pytest.importorskip("pandas")
    frame = tradeoff.to_pandas()
    assert isinstance(frame, pd.DataFrame) and len(frame) == len(tradeoff.rows)
    assert list(frame.columns) == [f.name for f in dataclasses.fields(TradeoffRow)]
    assert frame["budget_bytes"].tolist() == [r.budget_bytes for r in tradeoff.rows]
    blocks = tradeoff.blocks_table(frame=True)
    assert blocks.index.name == "budget_bytes" and list(blocks.columns) == list(tradeoff.prepared.regions.block_paths)


def test_to_pandas_without_pandas_says_how_to_install(tradeoff, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_pandas(name, *args, **kwargs):
        if name == "pandas":
            raise ImportError("No module named 'pandas'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pandas)
    with pytest.raises(ImportError, match="pip install pandas"):
        tradeoff.to_pandas()


def test_html_summaries(tradeoff):
    page = tradeoff._repr_html_()
    assert page.count("<table>") == 2 and page.count("<tr>") == 1 + len(tradeoff.rows) + 1 + len(tradeoff.references)
    assert "no plan below" in page
    plan = next(r.plan for r in tradeoff.rows if r.feasible and r.n_segments)
    page = plan._repr_html_()
    assert "<table>" in page and all(s.module_paths[0] in page for s in plan.segments)
    hostile = dataclasses.replace(plan, segments=(dataclasses.replace(plan.segments[0],
                                                                      module_paths=("<root>:add", "<script>")),))
    page = hostile._repr_html_()
    assert "<script>" not in page and "&lt;root&gt;:add" in page
    empty = tradeoff.rows[0].plan._repr_html_()
    assert "nothing checkpointed" in empty


# plots -----------------------------------------------------------------------------------------


def test_tradeoff_plots(tradeoff, tmp_path):
    fig = tradeoff.plot()
    assert isinstance(fig, matplotlib.figure.Figure)
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert "Pareto front" in labels and {"none (hand-made)", "every block (hand-made)", "√n (hand-made)"} <= set(labels)
    assert (tradeoff.knee() is None) or any(label.startswith("knee") for label in labels)
    fig.savefig(tmp_path / "curve.png")
    tradeoff.plot_blocks().savefig(tmp_path / "blocks.png")
    assert_png(tmp_path / "curve.png")
    assert_png(tmp_path / "blocks.png")


def test_plan_timeline(tradeoff, tmp_path):
    plan = next(r.plan for r in tradeoff.rows if r.feasible and r.n_segments >= 2)
    fig = planner.plot_timeline(plan)
    ax = fig.axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    with_plan = next(line for label, line in lines.items() if label.startswith("with plan"))
    n_backward = sum(b is not None for b in plan.timeline.backward_bytes)
    assert len(with_plan.get_xdata()) == len(plan.timeline.nodes) + n_backward
    assert max(with_plan.get_ydata()) == pytest.approx(plan.predicted_peak_bytes / 2**20)
    assert len(ax.patches) == 2 * len(plan.segments)  # forward and backward span per segment
    fig.savefig(tmp_path / "timeline.png")
    assert_png(tmp_path / "timeline.png")


def test_timeline_of_empty_and_loaded_plans(tradeoff, tmp_path):
    empty = tradeoff.rows[0].plan
    planner.plot_timeline(empty).savefig(tmp_path / "empty.png")
    assert_png(tmp_path / "empty.png")
    plan = next(r.plan for r in tradeoff.rows if r.feasible and r.n_segments)
    plan.save(tmp_path / "plan.json")
    loaded = load_plan(tmp_path / "plan.json")
    planner.plot_timeline(loaded).savefig(tmp_path / "loaded.png")
    assert_png(tmp_path / "loaded.png")
    with pytest.raises(ValueError, match="plan again"):
        planner.plot_timeline(dataclasses.replace(loaded, timeline=None))


def test_timeline_into_given_axes(tradeoff, tmp_path):
    from matplotlib.figure import Figure

    fig = Figure()
    left, right = fig.subplots(1, 2)
    assert planner.plot_timeline(tradeoff.rows[2].plan, ax=right) is fig
    assert right.get_lines() and not left.get_lines()
