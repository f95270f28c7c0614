"""Selective checkpointing (op-level saves inside segments): model, encoding, solver, rewrite, overrides."""

import dataclasses
import itertools
import random

import pytest
import torch
from conftest import assert_plan_is_exact, load_example
from forcing import every_save
from models import tower, tower_inputs
from torch.utils.flop_counter import FlopCounterMode

from planner import InfeasibleBudget
from planner.memory.saves import SaveOptions, cacheable, check_saves, partner, segment_of
from planner.memory.simulate import simulate
from planner.memory.synthetic import all_plans, memory_model, min_peak_brute, random_profile
from planner.pipeline import plan_for, plan_from_solution, prepare
from planner.solve.chain_dp import ChainDP
from planner.solve.cpsat import search
from planner.solve.deadline import Deadline
from planner.solve.default import solve
from planner.solve.peaks import encoded_peak
from planner.solve.result import NoSolution, Solution
from planner.solve.rotor import rotor_saves


def _model(seed, n=9):
    model = memory_model(random_profile(n, seed, skip_connections=True))
    return model, SaveOptions(candidates=tuple(o for o in range(model.n_nodes) if cacheable(model, o)))


def _plans_with_saves(model, options):
    for plan in all_plans(model):
        seg = segment_of(model, plan)
        inside = [o for o in options.candidates if seg[o] >= 0 and seg[partner(model, o)] == seg[o]]
        for k in range(len(inside) + 1):
            for saves in itertools.combinations(inside, k):
                try:  # a later segment may read a storage only SAC's cache holds
                    check_saves(model, plan, frozenset(saves))
                except ValueError:
                    continue
                yield plan, frozenset(saves)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_encoding_equals_simulator_with_saves(seed):
    model, options = _model(seed)
    rng = random.Random(seed)
    cases = list(_plans_with_saves(model, options))
    for plan, saves in rng.sample(cases, 12):
        encoded = encoded_peak(model, plan, saves=saves, options=options, deadline=Deadline.after(30))
        assert encoded == simulate(model, plan, saves).peak_bytes


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(2))
def test_selective_optimum_matches_brute_force(seed):
    """Saves and segments chosen jointly: CP-SAT's optimum equals the best of every plan x save set."""
    model, options = _model(seed, n=7)
    cases = [(p, s, simulate(model, p, s)) for p, s in _plans_with_saves(model, options)]
    lowest, highest = min_peak_brute(model), simulate(model, ()).peak_bytes
    for budget in (lowest, (lowest + highest) // 2, highest - 1):
        best = min(t.recompute_us for _, _, t in cases if t.peak_bytes <= budget)
        whole = min(t.recompute_us for p, s, t in cases if t.peak_bytes <= budget and not s)
        found = solve(model, budget, deadline=Deadline.after(20), options=options)
        assert found.status == "OPTIMAL" and found.recompute_us == best
        assert simulate(model, found.plan, found.saves).peak_bytes <= budget
        assert best <= whole


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3))
def test_save_variant_dp_is_exact_over_its_space(seed):
    """The chunk DP with per-segment save variants (planner.solve.rotor_saves) finds the least recompute of
    every plan x variant combination, from the smallest peak up to no checkpointing."""
    model, options = _model(seed, n=8)
    dp = ChainDP(model, 0, optimistic=False, candidates=options.candidates)
    cases = []
    for plan in all_plans(model):
        for combo in itertools.product(*[dp.variants(a, b) for a, b in plan]):
            saves = frozenset().union(*[v.saves for v in combo])
            try:
                check_saves(model, plan, saves)
            except ValueError:
                continue
            timeline = simulate(model, plan, saves)
            cases.append((timeline.peak_bytes, timeline.recompute_us))
    assert any(len(v.saves) for a in range(model.n_chunks) for b in range(a + 1, model.n_chunks + 1)
               for v in dp.variants(a, b))
    lowest, highest = min(peak for peak, _ in cases), simulate(model, ()).peak_bytes
    for budget in (lowest - 1, lowest, (3 * lowest + highest) // 4, (lowest + highest) // 2, highest):
        best = min((cost for peak, cost in cases if peak <= budget), default=None)
        if best is None:
            with pytest.raises(NoSolution):
                rotor_saves(model, budget, options, deadline=Deadline.after(30))
            continue
        found = rotor_saves(model, budget, options, deadline=Deadline.after(30))
        assert found.recompute_us == best
        assert simulate(model, found.plan, found.saves).peak_bytes <= budget


def test_saves_must_be_inside_segments():
    model, options = _model(0)
    with pytest.raises(ValueError, match="not inside a checkpointed segment"):
        simulate(model, (), frozenset({options.candidates[0]}))


@pytest.mark.slow
def test_overrides_are_honoured_or_infeasible():
    model, options = _model(1)
    o = options.candidates[0]
    lowest = min_peak_brute(model)
    forced = solve(model, simulate(model, ()).peak_bytes, deadline=Deadline.after(20),
                   options=SaveOptions(candidates=options.candidates, must_recompute=frozenset({o})))
    assert o not in forced.saves and segment_of(model, forced.plan)[o] >= 0
    outside = min(simulate(model, plan).peak_bytes for plan in all_plans(model) if segment_of(model, plan)[o] < 0)
    kept = solve(model, outside, deadline=Deadline.after(20),
                 options=SaveOptions(candidates=(), must_save=frozenset({o})))
    assert segment_of(model, kept.plan)[o] < 0
    every = frozenset(range(model.regions.end))
    with pytest.raises(NoSolution) as info:
        search(model, lowest, options=SaveOptions(must_save=every), deadline=Deadline.after(20))
    assert info.value.infeasible


@pytest.fixture(scope="module")
def gpt():
    example = load_example("gpt")
    return example, prepare(example["model"], inputs=example["inputs"], loss_fn=example["loss_fn"])


def _forced_saves(prepared, budget):
    """The whole-segment plan for ``budget`` with every allowed save in its segments (the solver weighs
    SAC's dispatch cost and may choose none; correctness must hold for any saves)."""
    memory = prepared.memory
    chunks = solve(memory, plan_for(prepared, budget, selective=False).budget_bytes, deadline=Deadline.after(30)).plan
    saves = every_save(prepared.profile, memory, chunks, prepared.rules.savable)
    assert saves
    peak = simulate(memory, chunks, saves).peak_bytes
    return plan_from_solution(prepared, Solution(plan=chunks, status="FIXED", recompute_us=0, bound_us=0,
                                                 solve_time_s=0.0, saves=saves), peak), chunks


@pytest.mark.slow
def test_gpt_selective_plans_are_exact_with_dropout(gpt, restore_buffers):
    """Dropout in every block: gradients equal the un-checkpointed model, peaks as predicted."""
    example, prepared = gpt
    plan = plan_for(prepared, "30%", selective=True, time_limit_s=10)
    whole = plan_for(prepared, "30%", selective=False)
    assert whole.solver_status == "OPTIMAL" and whole.recompute_bound_ms == whole.recompute_ms
    assert 0 <= plan.recompute_bound_ms <= plan.recompute_ms  # the gap the CLI reports
    if plan.chunks == whole.chunks:  # on a loaded machine the time limit may stop either at a coarser chunking
        assert plan.recompute_bound_ms <= whole.recompute_ms + 1e-9  # whole's plan is one of the selective plans
        if plan.solver_status == "OPTIMAL":  # the whole-segment search may run out of its share
            assert plan.recompute_ms <= whole.recompute_ms + 1e-9
    forced, _ = _forced_saves(prepared, "30%")
    assert "_ckplan_sac_contexts" in forced.source and sum(len(s.saved_nodes) for s in forced.segments) >= 8
    for candidate in (plan, forced):
        assert_plan_is_exact(example["model"], candidate, example["inputs"], example["loss_fn"], restore_buffers)


def test_tower_saves_with_batchnorm_and_dropout(restore_buffers):
    """BatchNorm statistics restored after the SAC re-run (the two contexts compose), dropout exact."""
    model, inputs = tower(), tower_inputs()

    def loss_fn(out):
        return out.square().mean()

    prepared = prepare(model, inputs=inputs, loss_fn=loss_fn)
    plan, chunks = _forced_saves(prepared, "50%")
    assert any(s.saved_nodes and s.restore_buffers for s in plan.segments)
    assert_plan_is_exact(model, plan, inputs, loss_fn, restore_buffers)
    # saved ops are not re-run: the same segments without saves re-run exactly the saved Linears more
    whole = plan_from_solution(prepared, Solution(plan=chunks, status="FIXED", recompute_us=0, bound_us=0,
                                                  solve_time_s=0.0), plan.budget_bytes)
    flops = {}
    for name, module in (("whole", whole.module), ("plan", plan.module)):
        restore_buffers(model)
        out = module(*inputs)
        with FlopCounterMode(display=False) as counter:
            loss_fn(out).backward()
        flops[name] = counter.get_total_flops()
    restore_buffers(model)
    saved = [n for s in plan.segments for n in s.saved_nodes if n.endswith(("fc1", "fc2"))]
    assert saved and flops["whole"] - flops["plan"] == 2 * 512 * 64 * 256 * len(saved)  # 512 rows, 64 <-> 256
    # overrides: a module path glob, a pattern matching nothing, contradictory overrides
    forced = plan_for(prepared, "50%", must_recompute=["blocks.*.fc1"])
    fc1 = {n for s in forced.segments for n in s.nodes if n.endswith("fc1")}
    assert len(fc1) == 4 and not fc1 & {n for s in forced.segments for n in s.saved_nodes}
    with pytest.raises(ValueError, match="'nope.*' matches no module path"):
        plan_for(prepared, "50%", must_save=["nope.*"])
    with pytest.raises(InfeasibleBudget, match="must_save/must_recompute make the budget infeasible"):
        plan_for(prepared, "50%", must_save=["blocks.*"])
    torch.testing.assert_close(plan.module(*inputs).shape, model(*inputs).shape)


TINY = """
import torch
from torch import nn
model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32)) for _ in range(3)])
inputs = (torch.randn(256, 32),)
"""


@pytest.mark.parametrize(("flags", "message"), [
    (["--must-save", "nope.*"], "must_save pattern 'nope.*' matches no module path or op name"),
    (["--must-recompute", "0.0", "--must-save", "0.0"], "matches both must_save and must_recompute"),
])
def test_cli_override_errors_exit_2_in_one_line(flags, message, tmp_path, monkeypatch, capsys):
    import sys

    from planner.report.cli import main
    from planner.report.model_file import MODEL_MODULE

    (tmp_path / "model.py").write_text(TINY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, MODEL_MODULE, raising=False)
    code = main(["model.py", "--quiet", *flags])
    out, err = capsys.readouterr()
    assert code == 2 and message in err and err.count("\n") == 1 and out == "", err


def test_cli_overrides_that_make_the_budget_infeasible_exit_3(tmp_path, monkeypatch, capsys):
    import sys

    from planner.report.cli import main
    from planner.report.model_file import MODEL_MODULE

    (tmp_path / "model.py").write_text(TINY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, MODEL_MODULE, raising=False)
    code = main(["model.py", "--quiet", "--must-save", "*", "--budget", "60%"])
    err = capsys.readouterr().err
    assert code == 3 and err.startswith("ckplan: infeasible: must_save/must_recompute make the budget infeasible")


def test_cli_whole_segments_and_saves(tmp_path, monkeypatch, capsys):
    import sys

    from planner.report.cli import main
    from planner.report.model_file import MODEL_MODULE

    (tmp_path / "model.py").write_text(TINY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    for flags in (["--whole-segments"], ["--must-recompute", "0.0"]):
        monkeypatch.delitem(sys.modules, MODEL_MODULE, raising=False)
        assert main(["model.py", "--budget", "70%", "--json", "--save", str(tmp_path / "p.json"), *flags]) == 0
        segments = __import__("json").loads(capsys.readouterr().out)["segments"]
        if flags == ["--whole-segments"]:
            assert segments and not any(s["saved_nodes"] for s in segments)
        else:
            assert any("_0_0" in s["nodes"] and "_0_0" not in s["saved_nodes"] for s in segments)


def test_policy_saves_fresh_outputs_of_marked_nodes_and_never_random_ops():
    from torch.utils.checkpoint import CheckpointPolicy

    from planner.rewrite.sac import policy, sac_mark

    aten = torch.ops.aten
    save, recompute = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    assert policy(None, aten.addmm.default) is recompute  # outside a bracket
    sac_mark(True)
    try:
        assert policy(None, aten.addmm.default) is save
        assert policy(None, aten.native_layer_norm.default) is save
        for op in (aten.native_dropout.default, aten.bernoulli.p, aten.rand.default,  # random: always re-run
                   aten.view.default, aten.t.default, aten.relu_.default):             # views, in place
            assert policy(None, op) is recompute, op
    finally:
        sac_mark(False)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(2))
def test_sac_dispatch_cost_is_charged_and_optimal(seed):
    """With SAC's per-op cost charged to segments that save, the optimum still equals brute force."""
    import numpy as np

    model, options = _model(seed, n=7)
    model = dataclasses.replace(model, sac_chunk_us=np.full(model.n_chunks, 150, dtype=np.int64))
    cases = [(p, s, simulate(model, p, s)) for p, s in _plans_with_saves(model, options)]
    for p, s, t in cases[:50]:
        assert t.recompute_us == simulate(model, p).recompute_us - sum(int(model.node_cost_us[o]) for o in s) + (
            150 * sum(b - a for i, (a, b) in enumerate(p) if any(segment_of(model, p)[o] == i for o in s)))
    lowest, highest = min_peak_brute(model), simulate(model, ()).peak_bytes
    for budget in (lowest, (lowest + highest) // 2):
        best = min(t.recompute_us for _, _, t in cases if t.peak_bytes <= budget)
        found = solve(model, budget, deadline=Deadline.after(20), options=options)
        assert found.status == "OPTIMAL" and found.recompute_us == best
