"""``torch.compile(plan.module)`` (inductor, CPU) trains exactly like the eager planned module.

Dropout is off: inductor draws its own random numbers, so masks differ from eager with or
without a plan. BatchNorm is on: segments that restore its statistics after recomputation must
compile too (torch.compile takes only plain functions as ``context_fn``) and update them once.
A selective plan's saves apply under compile too: the saved matmuls are kept, not re-run.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from forcing import every_save
from models import Tower
from torch._dynamo.utils import counters
from torch._inductor.compile_fx import compile_fx, compile_fx_inner
from torch.utils.checkpoint import CheckpointPolicy

from planner import optimize
from planner.memory.simulate import simulate
from planner.pipeline import plan_for, plan_from_solution, prepare
from planner.solve.deadline import Deadline
from planner.solve.default import solve
from planner.solve.result import Solution

pytestmark = pytest.mark.slow  # inductor compiles C++: ~10 s per model on 2 cores


def _tower() -> Tower:
    torch.manual_seed(0)
    model = Tower(width=32, depth=3)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def _step(module, model, x, loss_fn=lambda out: out.square().mean()):
    """Loss, every gradient and every buffer after one step of ``module`` (sharing ``model``'s state)."""
    for p in model.parameters():
        p.grad = None
    loss = loss_fn(module(x))
    loss.backward()
    return (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()},
            {n: b.clone() for n, b in model.named_buffers()})


@pytest.mark.parametrize("kwargs", [{}, {"world_size": 2, "selective": False}], ids=["one-device", "fsdp-units"])
def test_compiled_plan_trains_like_the_eager_plan(kwargs):
    model, x = _tower(), torch.randn(256, 32, generator=torch.Generator().manual_seed(1))
    plan = optimize(model, "60%", inputs=(x,), loss_fn=lambda out: out.square().mean(), **kwargs)
    assert plan.segments and any(s.restore_buffers for s in plan.segments)
    graphs = []

    def inductor(gm, example_inputs):  # inductor, recording the graph dynamo hands it
        graphs.append(gm)
        return compile_fx(gm, example_inputs)

    counters.clear()
    snapshot = [(b, b.clone()) for b in model.buffers()]
    compiled = _step(torch.compile(plan.module, backend=inductor), model, x)
    with torch.no_grad():
        for buffer, value in snapshot:
            buffer.copy_(value)
    eager = _step(plan.module, model, x)
    assert not counters["graph_break"] and len(graphs) == 1
    checkpoints = [n for n in graphs[0].graph.nodes if n.target is torch.ops.higher_order.tag_activation_checkpoint]
    assert len(checkpoints) == len(plan.segments)  # every segment is still checkpointed when compiled
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-5, atol=1e-7)
    for name in eager[1]:
        torch.testing.assert_close(compiled[1][name], eager[1][name], rtol=1e-5, atol=1e-6, msg=name)
    for name in eager[2]:  # BatchNorm statistics updated once, as in eager
        torch.testing.assert_close(compiled[2][name], eager[2][name], rtol=1e-5, atol=1e-6, msg=name)


MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)


def _gpt(layers: int):
    """The GPT example cut to ``layers`` blocks (inductor compiles ~10 s per block here), dropout off,
    loaded as an importable module (dynamo imports the module of every global it meets in inlined
    code, which fails for a ``runpy`` namespace)."""
    path = Path(__file__).resolve().parent.parent / "examples" / "gpt.py"
    spec = importlib.util.spec_from_file_location("ckplan_example_gpt", path)
    example = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = example
    spec.loader.exec_module(example)
    torch.manual_seed(0)
    model = example.GPT(example.Config(layers=layers))
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model, example.inputs, example.loss_fn


def _with_every_save(prepared, budget):
    """The whole-segment plan for ``budget`` with every save its segments allow."""
    memory = prepared.memory
    chunks = solve(memory, plan_for(prepared, budget, selective=False).budget_bytes, deadline=Deadline.after(30)).plan
    saves = every_save(prepared.profile, memory, chunks, prepared.rules.savable)
    peak = simulate(memory, chunks, saves).peak_bytes
    return plan_from_solution(prepared, Solution(plan=chunks, status="FIXED", recompute_us=0, bound_us=0,
                                                 solve_time_s=0.0, saves=saves), peak)


def test_compiled_selective_plan_keeps_its_saves():
    """GPT (4 blocks) at 50% with every allowed save: compiled, the loss and every gradient equal the
    un-checkpointed model's; the forward tags exactly the saved Linears' matmuls MUST_SAVE, and the
    backward re-runs none of them (while it re-runs other matmuls: the segments are still checkpointed).
    Whether a kept output is handed to backward is the partitioner's call: only when backward needs it."""
    model, inputs, loss_fn = _gpt(layers=4)
    prepared = prepare(model, inputs=inputs, loss_fn=loss_fn)
    plan = _with_every_save(prepared, "50%")
    modules = dict(model.named_modules())
    graph = prepared.captured.graph_module.graph
    saved = {n for s in plan.segments for n in s.saved_nodes}
    linears = [n for n in graph.nodes if n.name in saved and n.op == "call_module"
               and isinstance(modules[n.target], torch.nn.Linear)]
    assert "_ckplan_compiled_sac_contexts" in plan.source and len(linears) >= 4
    partitioned = {}

    def inner(gm, example_inputs, **kwargs):  # inductor, recording the partitioned forward and backward
        partitioned["backward" if kwargs.get("is_backward") else "forward"] = gm
        return compile_fx_inner(gm, example_inputs, **kwargs)

    dynamo_graphs = []

    def inductor(gm, example_inputs):
        dynamo_graphs.append(gm)
        return compile_fx(gm, example_inputs, inner_compile=inner)

    counters.clear()
    expected = _step(model, model, *inputs, loss_fn=loss_fn)
    compiled = _step(torch.compile(plan.module, backend=inductor), model, *inputs, loss_fn=loss_fn)
    assert not counters["graph_break"] and len(dynamo_graphs) == 1
    torch.testing.assert_close(compiled[0], expected[0], rtol=1e-4, atol=1e-5)
    for name in expected[1]:
        torch.testing.assert_close(compiled[1][name], expected[1][name], rtol=1e-4, atol=1e-5, msg=name)

    def matmuls(gm, policy):
        return [n for n in gm.graph.nodes if n.target in MATMULS and n.meta.get("recompute") is policy]

    forward, backward = partitioned["forward"], partitioned["backward"]
    kept = matmuls(forward, CheckpointPolicy.MUST_SAVE)
    assert len(kept) == len(linears)  # one addmm per saved Linear, as in eager
    assert not matmuls(backward, CheckpointPolicy.MUST_SAVE)  # a re-run copy would carry the tag
    assert matmuls(backward, CheckpointPolicy.PREFER_RECOMPUTE)  # the segments are still re-run
