"""Custom ``torch.autograd.Function``s in a model planned from its ATen ops (every Hugging Face model, TRL's fused
LM head, bitsandbytes' 4-bit matmul): each is one node that runs the Function itself, so its forward's ops run
under no grad as they do in training, only what ``ctx.save_for_backward`` keeps is counted, and its own backward
is what is timed. Plans stay exact and predicted to within 1%, inside and outside a checkpointed chain."""

from __future__ import annotations

import torch
from conftest import training_step
from torch import nn

from planner import enable
from planner.capture.api import capture
from planner.capture.inputs import as_inputs
from planner.capture.method import ExecutorKind
from planner.profiling.measure import measure_peak

WIDTH, VOCAB, ROWS = 64, 1024, 512


class ChunkedSquares(torch.autograd.Function):
    """Per-row mean square of ``x @ w.T`` in tiles written with ``mm(out=...)`` (autograd refuses that with
    gradients on), keeping only ``x`` and ``w`` for a backward that recomputes each tile, as TRL's chunked
    log-prob head does, in the autocast dtype of its tensors' device."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, chunk: int) -> torch.Tensor:
        device = x.device.type  # asked of the tensors' device, as TRL asks (a meta replay's tensors are on meta)
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        out = x.new_empty(x.shape[0], dtype=dtype)
        tile = x.new_empty(chunk, w.shape[0], dtype=dtype)
        for start in range(0, x.shape[0], chunk):
            rows = x[start:start + chunk]
            torch.mm(rows, w.t(), out=tile[:rows.shape[0]])
            out[start:start + chunk] = tile[:rows.shape[0]].pow(2).mean(1)
        ctx.save_for_backward(x, w)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, w = ctx.saved_tensors
        gx, gw = torch.empty_like(x), torch.zeros_like(w)
        for start in range(0, x.shape[0], ctx.chunk):
            rows = x[start:start + ctx.chunk]
            g = (rows @ w.t()) * (2 * grad[start:start + ctx.chunk, None] / w.shape[0])
            gx[start:start + ctx.chunk] = g @ w
            gw += g.t() @ rows
        return gx, gw, None


class Swish(torch.autograd.Function):
    """``x * sigmoid(x)`` keeping only its input: a Function inside a checkpointed block."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return grad * (s + x * s * (1 - s))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(Swish.apply(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return ChunkedSquares.apply(x, self.head.weight, 128).mean()


def _model() -> Net:
    torch.manual_seed(0)
    return Net()


def _inputs() -> tuple[torch.Tensor]:
    return (torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(1)),)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out


def test_a_custom_function_is_one_node_that_runs_it():
    model = _model()
    captured = capture(model, as_inputs(model, _inputs()), runs=ExecutorKind.HOOKS)
    called = [str(n.target.__name__) for n in captured.graph_module.graph.nodes
              if n.op == "call_function" and n.target.__name__.startswith("apply_")]
    assert called == ["apply_Swish"] * 4 + ["apply_ChunkedSquares"]
    assert not any("mm.out" in str(n.target) for n in captured.graph_module.graph.nodes)


def test_plans_of_a_model_with_custom_functions_are_exact_and_predicted_within_one_percent():
    model = _model()
    expected = training_step(model, model, _inputs(), _loss)[1]
    unplanned = measure_peak(model, as_inputs(model, _inputs()), _loss)
    plan = enable(model, "60%", inputs=_inputs(), loss_fn=_loss, follow_batch=False, time_limit_s=10)
    assert plan.segments and unplanned <= plan.baseline_peak_bytes <= 1.01 * unplanned
    measured = measure_peak(model, as_inputs(model, _inputs()), _loss)
    assert measured <= plan.budget_bytes
    assert measured <= plan.predicted_peak_bytes <= 1.01 * measured
    actual = training_step(model, model, _inputs(), _loss)[1]  # the model runs its plan in place (enable)
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)


def test_a_forward_wrapper_that_holds_the_models_own_forward_is_refused_when_a_group_is_planned():
    """A wrapper closing over the model's bound forward (TRL's fused LM head without its flag) would run the
    user's own modules, with their plan's hooks, from the copy a new group is planned on: a clear error, not a
    plan of the wrong graph, and the model untouched."""
    import types

    import pytest

    from planner.errors import CaptureError

    model = _model()
    own = model.forward
    model.forward = types.MethodType(lambda self, x: own(x), model)
    enable(model, "60%", inputs=_inputs(), loss_fn=_loss, follow_batch=True, time_limit_s=10)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CaptureError, match="ran the model's own blocks.0 module"):
        model(torch.randn(300, WIDTH))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_group_planned_in_training_replays_the_functions_on_meta_exactly():
    """A new shape group's memory comes from a meta replay, which runs each Function on meta tensors."""
    model = _model()
    plan = enable(model, "60%", inputs=_inputs(), loss_fn=_loss, follow_batch=True, time_limit_s=10)
    x = torch.randn(320, WIDTH, generator=torch.Generator().manual_seed(2))
    model(x).backward()  # plans the group of 320 rows
    group = next(g for key, g in plan.family.groups.items() if key != plan.family.example_group)
    for p in model.parameters():
        p.grad = None
    measured = measure_peak(model, as_inputs(model, (x,)), _loss)
    assert measured <= group.predicted_peak_bytes <= 1.01 * measured


class Switchable(Net):
    """``Net`` whose head is a plain matmul unless the call passes ``fused=True`` (as TRL's forward takes
    ``fused_lm_head=True``): the fused head keeps only its input, the plain one its logits."""

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        if fused:
            return ChunkedSquares.apply(x, self.head.weight, 128).mean()
        return self.head(x).pow(2).mean()


def test_calls_with_other_flags_than_the_examples_replan_its_group_for_the_forward_they_run():
    torch.manual_seed(0)
    model = Switchable()
    plan = enable(model, "90%", inputs=_inputs(), loss_fn=_loss, follow_batch=True, time_limit_s=10)
    example_plan = plan.family.groups[plan.family.example_group]
    (x,) = _inputs()
    model(x, fused=True).backward()  # the example's shape, another forward: its group planned again, once
    for p in model.parameters():
        p.grad = None
    replanned = plan.family.groups[plan.family.example_group]
    assert replanned is not example_plan and len(plan.family.groups) == 1
    from planner.rewrite.switching import Switching

    switching = next(h for h in model._forward_pre_hooks.values() if isinstance(h, Switching))
    assert switching.segments == replanned.segments  # its chains, not the example plan's: the key is the same
    measured = measure_peak(model, as_inputs(model, {"x": x, "fused": True}), _loss)
    assert measured <= replanned.predicted_peak_bytes <= 1.01 * measured
    assert measured <= plan.budget_bytes
