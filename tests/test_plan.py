"""The Plan API: module sharing, state_dict, hooks, eval mode, save/load/apply, summary."""

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import training_step
from models import DictModel, dict_loss, tower, tower_inputs

from planner import InfeasibleBudget, load_plan, optimize
from planner.capture.api import capture
from planner.capture.calls import SCOPE_KEY, entry_path
from planner.capture.inputs import as_inputs
from planner.profiling.measure import measure_peak
from planner.rewrite.graph import SegmentSpec, rewrite


@pytest.fixture(scope="module")
def planned():
    model = tower()
    return model, optimize(model, "55%", inputs=tower_inputs())


def test_module_shares_parameters_and_keeps_the_tree(planned):
    model, plan = planned
    assert plan.segments and plan.solver_status == "OPTIMAL"
    assert list(plan.module.state_dict()) == list(model.state_dict())
    for (name, p), (name2, q) in zip(model.named_parameters(), plan.module.named_parameters()):
        assert name == name2 and p is q
    for (_, b), (_, c) in zip(model.named_buffers(), plan.module.named_buffers()):
        assert b is c
    assert plan.module.get_submodule("blocks.2.fc1") is model.blocks[2].fc1
    assert "torch.utils.checkpoint.checkpoint(" in plan.source and "use_reentrant = False" in plan.source


def test_model_is_not_modified(planned):
    model, plan = planned
    assert type(model).__name__ == "Tower" and type(plan.module).__name__ == "CheckpointedTower"
    assert not any(k.startswith(("_tensor_constant", "_ckplan")) for k in vars(model))


def test_hooks_of_layers_still_run(planned):
    model, plan = planned
    calls = []
    handle = model.blocks[1].fc1.register_forward_hook(lambda *a: calls.append(1))
    try:
        plan.module(*tower_inputs()).sum().backward()
    finally:
        handle.remove()
        model.zero_grad(set_to_none=True)
    assert calls, "a torch.nn layer is still called as a module, so its hooks run"


def test_eval_mode_runs_the_original_forward(planned):
    model, plan = planned
    plan.module.eval()
    model.eval()
    try:
        with torch.no_grad():
            torch.testing.assert_close(plan.module(*tower_inputs()), model(*tower_inputs()), rtol=0, atol=0)
    finally:
        plan.module.train()
        model.train()


def test_save_load_apply_to_a_fresh_instance(planned, tmp_path, restore_buffers):
    _, plan = planned
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = load_plan(path)
    assert loaded.to_dict() == plan.to_dict() and loaded.module is None
    fresh = tower(seed=3)
    applied = loaded.apply(fresh)
    restore_buffers(fresh)
    expected = training_step(fresh, fresh, tower_inputs(), lambda y: y.square().mean(), seed=5)
    restore_buffers(fresh)
    actual = training_step(applied, fresh, tower_inputs(), lambda y: y.square().mean(), seed=5)
    torch.testing.assert_close(actual[0], expected[0], rtol=1e-4, atol=1e-5)
    for key in expected[1]:
        torch.testing.assert_close(actual[1][key], expected[1][key], rtol=1e-4, atol=1e-5)
    for key in expected[2]:
        torch.testing.assert_close(actual[2][key], expected[2][key], rtol=0, atol=0)


def test_apply_to_another_architecture_is_refused(planned):
    _, plan = planned
    with pytest.raises(ValueError, match="fingerprint"):
        plan.apply(torch.nn.Sequential(torch.nn.Linear(64, 64)))


@pytest.mark.parametrize("content", ["{not json", json.dumps({"format": "other"}),
                                     json.dumps({"format": "ckplan-plan", "version": 99})])
def test_load_plan_rejects_other_files(tmp_path, content):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match="ckplan|JSON|version"):
        load_plan(path)


def test_summary_and_numbers_agree(planned):
    _, plan = planned
    text = plan.summary()
    assert f"{len(plan.segments)} checkpointed segment" in text and "blocks." in text
    assert plan.predicted_peak_bytes <= plan.budget_bytes < plan.baseline_peak_bytes
    assert plan.predicted_overhead == pytest.approx(plan.recompute_ms / plan.step_ms, rel=0.02)
    assert plan.recompute_ms == pytest.approx(sum(s.recompute_ms for s in plan.segments), abs=1e-6)


def test_budget_at_baseline_gives_the_empty_plan():
    model = tower()
    plan = optimize(model, "100%", inputs=tower_inputs())
    assert plan.segments == () and plan.predicted_overhead == 0.0
    assert plan.predicted_peak_bytes == plan.baseline_peak_bytes


def test_dict_inputs_and_nested_outputs(restore_buffers):
    torch.manual_seed(0)
    model = DictModel()
    inputs = {"x": torch.randn(2048, 64), "scale": torch.tensor(2.0)}
    with pytest.raises(InfeasibleBudget) as info:
        optimize(model, 1, inputs=inputs, loss_fn=dict_loss)
    plan = optimize(model, info.value.min_peak_bytes, inputs=inputs, loss_fn=dict_loss)
    assert plan.segments
    expected = training_step(model, model, inputs, lambda out: dict_loss(out))
    actual = training_step(plan.module, model, inputs, lambda out: dict_loss(out))
    for key in expected[1]:
        torch.testing.assert_close(actual[1][key], expected[1][key], rtol=1e-4, atol=1e-5)
    measured = measure_peak(plan.module, as_inputs(model, inputs), dict_loss)
    assert measured <= plan.budget_bytes
    assert abs(plan.predicted_peak_bytes - measured) <= 0.10 * measured


def test_eval_mode_of_a_sequential_whose_argument_is_named_input():
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(64, 256), torch.nn.GELU(),
                                                                torch.nn.Linear(256, 64))])
    x = torch.randn(512, 64)
    plan = optimize(mlp, "80%", inputs=(x,))
    assert plan.segments
    plan.module.eval()
    mlp.eval()
    with torch.no_grad():
        torch.testing.assert_close(plan.module(x), mlp(x), rtol=0, atol=0)


class _TiedBlock(torch.nn.Module):
    """Reads a weight Parameter that another block holds too (an LM head tied to its embedding)."""

    def __init__(self, weight: torch.nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x):
        return x + torch.tanh(F.linear(x, self.weight))


class _TiedModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        weight = torch.nn.Parameter(torch.randn(16, 16) / 4)
        self.blocks = torch.nn.ModuleList([_TiedBlock(weight), torch.nn.Linear(16, 16), _TiedBlock(weight)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("checkpointed", [("blocks.0",), ("blocks.2",), ("blocks.0", "blocks.2")],
                         ids=["first holder", "second holder", "both holders"])
def test_tied_weight_stays_one_parameter_with_exact_gradients(checkpointed):
    # fx reads a parameter once per trace, where it is first used: inside blocks.0 in the captured
    # graph, inside blocks.2 in the rewriter's re-trace when blocks.0 stays a module call
    torch.manual_seed(0)
    model = _TiedModel()
    x = torch.randn(8, 16)
    captured = capture(model, as_inputs(model, (x,)))
    segments = [SegmentSpec(nodes=tuple(n.name for n in captured.graph_module.graph.nodes
                                        if any(entry_path(e) == path for e in n.meta.get(SCOPE_KEY, ()))))
                for path in checkpointed]
    planned = rewrite(model, captured, segments)
    assert planned.source.count("torch.utils.checkpoint.checkpoint(") == len(checkpointed)
    assert planned.module.blocks[0].weight is planned.module.blocks[2].weight is model.blocks[0].weight
    assert [n for n, _ in planned.module.named_parameters()] == [n for n, _ in model.named_parameters()]
    expected = training_step(model, model, (x,), lambda y: y.square().mean())
    actual = training_step(planned.module, model, (x,), lambda y: y.square().mean())
    torch.testing.assert_close(actual[0], expected[0], rtol=0, atol=0)
    assert actual[1].keys() == expected[1].keys() == {"blocks.0.weight", "blocks.1.weight", "blocks.1.bias"}
    for key in expected[1]:  # blocks.0.weight: both uses accumulate into the one gradient
        torch.testing.assert_close(actual[1][key], expected[1][key], rtol=0, atol=0, msg=key)
