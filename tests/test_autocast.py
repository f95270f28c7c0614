"""Mixed precision as good as fp32: a Hugging Face Qwen2 planned inside ``torch.autocast(dtype=torch.bfloat16)``
with its own loss (no ``loss_fn``) plans, keeps op outputs where its fp32 plan does, trains with the unplanned
model's gradients, and its bf16 step measures within 1% of the prediction, never over the budget, at a roomy budget
and one near the smallest peak any plan reaches. Backward runs inside the forward's ``torch.autocast`` (the re-run
meets the forward's cached parameter casts) and outside it (it meets none)."""

from __future__ import annotations

import pytest
import torch

from planner import InfeasibleBudget, plan_for, prepare
from planner.capture.inputs import as_inputs
from planner.common.loop import TrainingLoop
from planner.profiling.measure import measure_loop_peak

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow


def qwen2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=352, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    return transformers.Qwen2ForCausalLM(config)


def batch() -> dict:
    ids = torch.randint(0, 512, (4, 96), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def _grads(module: torch.nn.Module, model: torch.nn.Module, inputs: dict, *, backward_inside: bool) -> dict:
    for p in model.parameters():
        p.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = module(**inputs).loss
        if backward_inside:
            loss.backward()
    if not backward_inside:
        loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def prepared():
    model = qwen2()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the caller's own autocast, read by prepare
        half = prepare(model, inputs=batch(), keep_output=False, follow_batch=False)
    full = prepare(model, inputs=batch(), keep_output=False, follow_batch=False)
    return model, half, full


@pytest.mark.parametrize("budget", ["70%", "floor"])
def test_a_plan_made_under_autocast_keeps_op_outputs_and_is_exact(prepared, budget):
    model, half, full = prepared
    assert half.loop.autocast == "bfloat16" and full.loop.autocast is None
    if budget == "floor":
        with pytest.raises(InfeasibleBudget) as info:
            plan_for(half, 1)
        budget = int(1.03 * info.value.min_peak_bytes)
    plan = plan_for(half, budget)
    if budget == "70%":
        assert any(s.saved_ops for s in plan_for(full, "70%").segments)
        assert any(s.saved_ops for s in plan.segments)
    assert "autocast to bfloat16" in plan.counted
    inputs = batch()
    for inside in (True, False):
        expected = _grads(model, model, inputs, backward_inside=inside)
        actual = _grads(plan.module, model, inputs, backward_inside=inside)
        for name in expected:
            torch.testing.assert_close(actual[name], expected[name], rtol=0, atol=0, msg=name)
    for p in model.parameters():
        p.grad = None
    loop = TrainingLoop(keep_output=False, autocast="bfloat16")
    measured = measure_loop_peak(plan.module, [as_inputs(model, inputs)], loop=loop)
    assert measured <= plan.budget_bytes
    assert measured <= plan.predicted_peak_bytes <= 1.01 * measured, (measured, plan.predicted_peak_bytes)
