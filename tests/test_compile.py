"""``torch.compile(plan.module)`` (inductor, CPU) trains exactly like the eager planned module.

Dropout is off: inductor draws its own random numbers, so masks differ from eager with or
without a plan. BatchNorm is on: segments that restore its statistics after recomputation must
compile too (torch.compile takes only plain functions as ``context_fn``) and update them once.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.compile_fx import compile_fx

from models import Tower
from planner import optimize

pytestmark = pytest.mark.slow  # inductor compiles C++: ~10 s per model on 2 cores


def _tower() -> Tower:
    torch.manual_seed(0)
    model = Tower(width=32, depth=3)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def _step(module, model, x):
    """Loss, every gradient and every buffer after one step of ``module`` (sharing ``model``'s state)."""
    for p in model.parameters():
        p.grad = None
    loss = module(x).square().mean()
    loss.backward()
    return (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()},
            {n: b.clone() for n, b in model.named_buffers()})


@pytest.mark.parametrize("kwargs", [{}, {"world_size": 2}], ids=["one-device", "fsdp-units"])
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
