"""Plans run by module hooks (Hugging Face models) under ``torch.compile``: planned with ``compilable=True``, every
segment is one module call, which compiled code runs through ``torch.utils.checkpoint``. The whole model compiled,
each decoder layer compiled in place (torchtitan's way) and ``enable`` then ``torch.compile`` train like the
unplanned model compiled; the re-run is in the compiled backward; a plan of several calls is refused in one line.
Dropout is off: compiled code draws its own random numbers."""

from __future__ import annotations

import copy

import pytest
import torch

from planner import disable, enable, optimize
from planner.capture.inputs import as_inputs
from planner.profiling.measure import measure_peak
from planner.rewrite.compiled_forward import CompiledChainError

pytestmark = pytest.mark.slow  # each compiles the model: ~10-30 s on 2 cores


def _decoder(kind: str = "qwen2"):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=1000, n_embd=128, n_layer=4, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            use_cache=False))
    else:
        config = (transformers.Qwen2Config if kind == "qwen2" else transformers.LlamaConfig)(
            vocab_size=1000, hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, use_cache=False)
        model = (transformers.Qwen2ForCausalLM if kind == "qwen2" else transformers.LlamaForCausalLM)(config)
    ids = torch.randint(0, 1000, (4, 128), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}


def _step(module, batch) -> tuple[float, list[torch.Tensor]]:
    for p in module.parameters():
        p.grad = None
    loss = module(**batch).loss
    loss.backward()
    grads = [p.grad.clone() for p in module.parameters()]
    for p in module.parameters():
        p.grad = None
    return loss.item(), grads


def _close(a: tuple[float, list[torch.Tensor]], b: tuple[float, list[torch.Tensor]]) -> bool:
    return a[0] == pytest.approx(b[0], rel=1e-5) and all(torch.allclose(x, y, rtol=1e-4, atol=1e-6)
                                                          for x, y in zip(a[1], b[1]))


def _backward_mms(module, batch) -> int:
    """Matmuls (``mm``, ``addmm``) in the backward graphs AOTAutograd makes of one compiled step of ``module``: the
    re-run is there."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    found: list[int] = []

    def backward(gm, example):
        found.append(sum(node.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
                         for node in gm.graph.nodes))
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    compiled = torch.compile(module, backend=aot_autograd(fw_compiler=lambda gm, ex: make_boxed_func(gm.forward),
                                                          bw_compiler=backward))
    compiled(**batch).loss.backward()
    for p in module.parameters():
        p.grad = None
    return sum(found)


@pytest.mark.parametrize("kind", ["qwen2", "llama", "gpt2"])
def test_the_whole_model_compiled_trains_like_the_model_compiled_and_re_runs_in_backward(kind):
    model, batch = _decoder(kind)
    reference = copy.deepcopy(model)
    plan = optimize(model, "60%", inputs=batch, compilable=True, follow_batch=False)
    assert plan.segments and all(len(s.chain) == 1 for s in plan.segments)
    unplanned_graphs = torch._dynamo.explain(reference)(**batch).graph_count
    assert torch._dynamo.explain(plan.module)(**batch).graph_count == unplanned_graphs  # no new graph break
    assert unplanned_graphs == (2 if kind == "gpt2" else 1)  # GPT-2's: transformers logs its unknown loss_type
    torch._dynamo.reset()
    expected = _step(torch.compile(reference), batch)
    compiled = torch.compile(plan.module)
    assert _close(_step(compiled, batch), expected)
    example = as_inputs(model, batch)
    assert measure_peak(compiled, example) < measure_peak(torch.compile(reference), example)
    assert _backward_mms(plan.module, batch) > _backward_mms(reference, batch)  # the segments' matmuls, re-run


def test_each_layer_compiled_in_place_and_a_plan_that_follows_the_batch():
    """torchtitan's style (``layer.compile()`` for each block) on a plan that follows the batch (the default for a
    Hugging Face model): the smaller batch switches plans outside the compiled layers."""
    model, batch = _decoder()
    reference = copy.deepcopy(model)
    plan = optimize(model, "60%", inputs=batch, compilable=True)
    assert plan.family is not None
    for layer in plan.module.model.layers:
        layer.compile(backend="aot_eager")
    for layer in reference.model.layers:
        layer.compile(backend="aot_eager")
    for rows in (4, 2):
        short = {name: value[:rows] for name, value in batch.items()}
        assert _close(_step(plan.module, short), _step(reference, short)), rows


def test_enable_then_compile():
    model, batch = _decoder()
    reference = copy.deepcopy(model)
    enable(model, "60%", inputs=batch, compilable=True, follow_batch=False)
    try:
        torch._dynamo.reset()
        assert _close(_step(torch.compile(model, backend="aot_eager"), batch),
                      _step(torch.compile(reference, backend="aot_eager"), batch))
    finally:
        disable(model)


def test_a_segment_of_several_calls_under_compile_is_one_line_naming_the_way_out():
    model, batch = _decoder()
    plan = optimize(model, "60%", inputs=batch, follow_batch=False)
    if all(len(s.chain) == 1 for s in plan.segments):
        pytest.skip("this plan has no segment of several calls")
    torch._dynamo.reset()
    with pytest.raises(CompiledChainError, match=r"compilable=True \(ckplan --compilable\)"):
        torch.compile(plan.module, backend="aot_eager")(**batch)
