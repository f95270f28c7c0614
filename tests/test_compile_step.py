"""Plans for a step run under ``torch.compile`` (``compile_backend``): fitted to the compiled step as measured, so the
budget holds for the step the user compiles. ``torch.compile(plan.module)`` with the same backend peaks within the
budget and within 2% of the plan's ``compiled_step`` (where the unplanned model compiled is over it), with the
unplanned compiled model's gradients and no new graph break; ``enable`` plans the user's object the same way. The
input embedding's graph break (``Graphs.INPUTS_APART``) travels with the plan, through ``Plan.apply`` too, and
comes off with ``disable``. The stacks are in ``tests/test_compile_stacks.py``."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from test_compile_hooks import _step

from planner import CompileError, OptionError, disable, enable, load_plan, optimize, optimize_compiled
from planner.capture.inputs import as_inputs
from planner.compiled.backend import Graphs
from planner.plan import CompiledStep
from planner.profiling.measure import measure_peak
from planner.rewrite.modules import _graph_break_after, break_graph_after

BACKEND = "aot_eager"  # AOTAutograd's graphs and partitioner without inductor's code generation (seconds, not minutes)


def _decoder():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=2000, hidden_size=128, intermediate_size=352, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    ids = torch.randint(0, 2000, (4, 128), generator=torch.Generator().manual_seed(1))
    return transformers.Qwen2ForCausalLM(config), {"input_ids": ids, "labels": ids}


def _graphs(module, batch) -> int:
    torch._dynamo.reset()
    return torch._dynamo.explain(module)(**batch).graph_count


@pytest.mark.slow
def test_the_plan_compiled_fits_the_budget_as_the_plan_measured_it(tmp_path):
    model, batch = _decoder()
    reference = copy.deepcopy(model)
    plan = optimize(model, "70%", inputs=batch, compile_backend=BACKEND, keep_output=False, time_limit_s=10)
    assert plan.compiled_step is not None and plan.compiled_step.backend == BACKEND
    assert plan.segments and all(len(s.chain) == 1 for s in plan.segments)
    assert _graphs(plan.module, batch) == _graphs(reference, batch)  # no new graph break
    torch._dynamo.reset()
    compiled, unplanned = torch.compile(plan.module, backend=BACKEND), torch.compile(reference, backend=BACKEND)
    loss, grads = _step(compiled, batch)
    expected_loss, expected = _step(unplanned, batch)
    assert loss == pytest.approx(expected_loss, rel=1e-5)
    assert all(torch.allclose(g, e, rtol=1e-4, atol=1e-6) for g, e in zip(grads, expected))
    example = as_inputs(model, batch)
    peak = measure_peak(compiled, example, keep_output=False)
    assert peak <= plan.budget_bytes < measure_peak(unplanned, example, keep_output=False)
    assert abs(peak / plan.compiled_step.peak_bytes - 1) <= 0.02, (peak, plan.compiled_step)
    assert plan.compiled_step.peak_bytes <= plan.budget_bytes
    assert "compiled step (aot_eager) measured" in plan.summary()
    plan.save(tmp_path / "plan.json")
    assert load_plan(tmp_path / "plan.json").compiled_step == plan.compiled_step


@pytest.mark.slow
def test_enable_fits_the_users_object_to_its_compiled_step():
    model, batch = _decoder()
    reference = copy.deepcopy(model)
    plan = enable(model, "70%", inputs=batch, compile_backend=BACKEND, time_limit_s=10)
    try:
        assert plan.module is model and plan.compiled_step is not None
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=BACKEND)
        _step(compiled, batch)
        peak = measure_peak(compiled, as_inputs(model, batch))
        assert peak <= plan.budget_bytes
        assert abs(peak / plan.compiled_step.peak_bytes - 1) <= 0.02, (peak, plan.compiled_step)
        assert peak < measure_peak(torch.compile(reference, backend=BACKEND), as_inputs(reference, batch))
    finally:
        disable(model)


def test_the_input_embeddings_graph_break_travels_with_the_plan_and_comes_off_with_it():
    model, batch = _decoder()
    whole = _graphs(model, batch)
    enable(model, "60%", inputs=batch, compilable=True, follow_batch=False, time_limit_s=5)
    break_graph_after(model, model.get_input_embeddings())
    broken = _graphs(model, batch)
    assert broken > whole
    disable(model)
    assert _graphs(model, batch) == whole
    plan = optimize(model, "60%", inputs=batch, compilable=True, follow_batch=False, time_limit_s=5)
    apart = CompiledStep(backend="inductor", peak_bytes=1, baseline_peak_bytes=2, graphs=Graphs.INPUTS_APART)
    applied = replace(plan, compiled_step=apart).apply(copy.deepcopy(model))
    assert _graph_break_after in applied.get_input_embeddings()._forward_hooks.values()
    assert _graph_break_after not in plan.apply(copy.deepcopy(model)).get_input_embeddings()._forward_hooks.values()
    assert _graphs(model, batch) == whole  # the user's model has no hook


@pytest.mark.parametrize(("options", "named"), [
    ({"device": "h100"}, "device="), ({"follow_batch": True}, "follow_batch="), ({"offload": True}, "offload="),
    ({"world_size": 2}, "world_size="),
])
def test_a_compiled_step_is_measured_here_for_one_shape_without_offloads(options, named):
    with pytest.raises(OptionError, match=f"drop {named}"):
        optimize(torch.nn.Linear(4, 4), "50%", inputs=(torch.ones(2, 4),), compile_backend="inductor", **options)


def test_compile_backend_names_a_backend_and_is_not_an_option_of_optimize_compiled():
    for wrong in ("", "inductr"):
        with pytest.raises(OptionError, match="name of a torch.compile backend .*inductor"):
            optimize(torch.nn.Linear(4, 4), "50%", inputs=(torch.ones(2, 4),), compile_backend=wrong)
    with pytest.raises(OptionError, match="compile_backend"):
        optimize_compiled(torch.nn.Linear(4, 4), "50%", inputs=(torch.ones(2, 4),), compile_backend="inductor")


def test_a_model_that_does_not_compile_with_the_backend_is_one_line_while_planning():
    """Before any training step: torch's test backend that fails on every graph with a relu."""
    class Relu(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x)

    model = torch.nn.Sequential(torch.nn.Linear(8, 64), Relu(), torch.nn.Linear(64, 8))
    torch._dynamo.reset()
    with pytest.raises(CompileError, match=r"^the model does not compile with torch.compile's "
                                           r"'relu_compile_error_TESTING_ONLY' backend \(.+\): train it eagerly, "
                                           r"or plan the eager step with compilable=True[^\n]*$"):
        optimize(model, "50%", inputs=(torch.randn(16, 8),), compile_backend="relu_compile_error_TESTING_ONLY")
