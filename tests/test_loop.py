"""The budget holds in the loop people run: gradients of earlier micro-steps, Lightning's zero_grad order,
``zero_grad(set_to_none=False)``, the optimizer's state and its step, each counted and predicted as measured."""

from __future__ import annotations

import copy

import pytest
import torch
from models import tower, tower_inputs

from planner import InfeasibleBudget, optimize, prepare
from planner.capture.inputs import as_inputs
from planner.common.loop import Gradients, OptimizerState, TrainingLoop, ZeroGrad
from planner.errors import OptionError
from planner.memory.simulate import STEP_PHASE, simulate
from planner.profiling.measure import measure_loop_peak
from planner.profiling.optimizer import optimizer_state


def loss_fn(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


@pytest.mark.parametrize(("loop", "expected"), [
    (TrainingLoop(), Gradients.NONE),
    (TrainingLoop(gradient_accumulation_steps=4), Gradients.THROUGHOUT),
    (TrainingLoop(set_to_none=False), Gradients.THROUGHOUT),
    (TrainingLoop(zero_grad=ZeroGrad.BEFORE_BACKWARD), Gradients.IN_FORWARD),
    (TrainingLoop(zero_grad=ZeroGrad.BEFORE_BACKWARD, gradient_accumulation_steps=2), Gradients.THROUGHOUT),
])
def test_the_loop_says_which_earlier_gradients_are_alive(loop, expected):
    assert loop.gradients is expected


def test_what_is_counted_is_said_in_the_summary_and_survives_json():
    loop = TrainingLoop(gradient_accumulation_steps=4, keep_output=False, autocast="bfloat16",
                        optimizer=OptimizerState(kind="AdamW", state_bytes=2048, description="2 x float32 parameters"))
    assert loop.counted() == ("AdamW state 2.00 KiB (2 x float32 parameters)",
                              "gradients alive in forward and backward (4 micro-steps)", "autocast to bfloat16",
                              "output dropped before backward")
    held = TrainingLoop(gradient_accumulation_steps=4, batches_held=4)
    assert "4 micro-batches held at once" in held.counted() and TrainingLoop.from_dict(held.to_dict()) == held
    assert TrainingLoop.from_dict(loop.to_dict()) == loop


def _trainable_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def test_an_optimizer_object_is_read_for_its_kind_state_and_parameters():
    model = tower()
    model.head.requires_grad_(False)  # frozen: no state
    trainable = _trainable_bytes(model)
    adamw = optimizer_state(torch.optim.AdamW(p for p in model.parameters() if p.requires_grad), model,
                            device_type="cpu")
    steps = 4 * sum(1 for p in model.parameters() if p.requires_grad)  # a float32 ``step`` each, on the host
    assert adamw.kind == "AdamW" and adamw.description == "2 x float32 parameters"
    assert adamw.state_bytes == 2 * trainable + steps
    assert adamw.step_bytes > 0  # its update allocates while it runs
    assert optimizer_state("adamw", model, device_type="cpu").state_bytes == 2 * trainable + steps
    assert optimizer_state("adamw", model, device_type="cuda").state_bytes == 2 * trainable  # steps on the host
    assert optimizer_state(torch.optim.SGD(model.parameters(), lr=0.1), model, device_type="cpu").state_bytes == 0
    momentum = torch.optim.SGD([{"params": model.blocks[0].parameters(), "momentum": 0.9},
                                {"params": model.blocks[1:].parameters()}], lr=0.1)
    assert optimizer_state(momentum, model, device_type="cpu").state_bytes == _trainable_bytes(model.blocks[0])
    assert optimizer_state(1000, model, device_type="cpu", shards=4).state_bytes == 250
    # torch's foreach step on a GPU holds temporaries of every parameter at once; the per-parameter one does not
    assert optimizer_state("adamw", model, device_type="cuda").step_bytes > adamw.step_bytes
    assert all(p.grad is None for p in model.parameters())  # measured on meta copies: nothing of the model touched


@pytest.mark.parametrize(("value", "says"), [
    ("adamax", "unknown optimizer='adamax'"), (-1, "negative"), (object(), "takes a torch.optim.Optimizer"),
])
def test_a_bad_optimizer_is_one_line(value, says):
    with pytest.raises(OptionError, match=says) as info:
        optimizer_state(value, tower(), device_type="cpu")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("options", "says"), [
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps must be an integer >= 1"),
    ({"batches_held": 0}, "batches_held must be an integer >= 1"),
    ({"zero_grad": "after_backward"}, "zero_grad must be one of 'before_forward', 'before_backward'"),
    ({"autocast": "fp8"}, "autocast must be one of"),
    ({"gradient_accumulation_steps": 2, "world_size": 2}, "not modelled on the ranks of an FSDP job"),
])
def test_bad_loop_options_are_one_line(options, says):
    with pytest.raises(OptionError, match=says):
        optimize(tower(), "60%", inputs=tower_inputs(), loss_fn=loss_fn, **options)


LOOPS = {  # name: (options, the loop they describe)
    "accumulation": ({"gradient_accumulation_steps": 4}, TrainingLoop(gradient_accumulation_steps=4)),
    "lightning": ({"zero_grad": "before_backward"}, TrainingLoop(zero_grad=ZeroGrad.BEFORE_BACKWARD)),
    "zeros": ({"set_to_none": False}, TrainingLoop(set_to_none=False)),
    "adamw": ({"optimizer": "adamw", "gradient_accumulation_steps": 2},
              TrainingLoop(gradient_accumulation_steps=2)),
    "held": ({"gradient_accumulation_steps": 4, "batches_held": 4},  # Trainer: a step's micro-batches together
             TrainingLoop(gradient_accumulation_steps=4, batches_held=4)),
}


@pytest.mark.parametrize("name", list(LOOPS))
def test_each_loop_is_predicted_as_measured_and_fits(name):
    """Two optimizer steps of the loop, measured: within the budget, predicted within 1% and never under; the plan
    made without saying the loop measures over its own prediction."""
    options, loop = LOOPS[name]
    model, inputs = tower(), tower_inputs()
    plan = optimize(model, "70%", inputs=inputs, loss_fn=loss_fn, **options)
    assert plan.counted and plan.segments
    optimizer = torch.optim.AdamW(model.parameters()) if "optimizer" in options else None
    window = [as_inputs(model, tuple(t.clone() for t in inputs)) for _ in range(loop.batches_held)]
    batches = window * (2 * loop.gradient_accumulation_steps // loop.batches_held)
    measured = measure_loop_peak(plan.module, batches, loss_fn, loop=loop, optimizer=optimizer)
    assert measured <= plan.budget_bytes
    assert measured <= plan.predicted_peak_bytes <= 1.01 * measured, (measured, plan.predicted_peak_bytes)
    unaware = optimize(copy.deepcopy(tower()), "70%", inputs=inputs, loss_fn=loss_fn)
    blind = measure_loop_peak(unaware.module, batches, loss_fn, loop=loop,
                              optimizer=torch.optim.AdamW(unaware.module.parameters()) if optimizer else None)
    assert blind > unaware.predicted_peak_bytes  # what the loop holds is real: unsaid, the prediction is under


def test_an_optimizer_step_larger_than_backward_is_the_peak():
    """Wide layers on a batch of one row: the activations are nothing beside AdamW's step, whose moment is the peak
    every plan shares; a budget below it is infeasible and says so."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.GELU(), torch.nn.Linear(512, 512))
    inputs = (torch.randn(1, 512),)
    prepared = prepare(model, inputs=inputs, loss_fn=loss_fn, optimizer="adamw")
    baseline = simulate(prepared.memory, ())
    assert baseline.peak_phase == STEP_PHASE
    optimizer = torch.optim.AdamW(model.parameters())
    measured = measure_loop_peak(model, [as_inputs(model, inputs)] * 2, loss_fn, loop=prepared.loop,
                                 optimizer=optimizer)
    assert measured <= baseline.peak_bytes <= 1.01 * measured
    with pytest.raises(InfeasibleBudget) as info:
        optimize(model, baseline.peak_bytes - 1, inputs=inputs, loss_fn=loss_fn, optimizer="adamw")
    assert info.value.min_peak_bytes == baseline.peak_bytes
