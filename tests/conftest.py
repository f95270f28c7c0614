"""Shared helpers: loading the bundled examples and running one comparable training step."""

from __future__ import annotations

import functools
import os
import runpy
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# One timed step of each kind per profile, in this process and the ones it starts (CLI runs, gloo ranks, example
# scripts): what the tests check does not depend on timing noise, and a busy machine (the other worker) would
# otherwise time six steps and more of every kind. Tests of the timing itself set their own steps.
os.environ.setdefault("CKPLAN_TIMING_RUNS", "1")

if os.environ.get("PYTEST_XDIST_WORKER"):  # one worker per core: no intra-op threads competing
    torch.set_num_threads(1)


class Calls:
    """Counts the training calls of a module (its forward and every re-run of it)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.count = 0
        self.handle = module.register_forward_pre_hook(self)

    def __call__(self, module, args) -> None:
        if module.training and torch.is_grad_enabled():
            self.count += 1


@pytest.fixture
def timed_as_users_are(monkeypatch):
    """Profiles in the test time as many steps as users' do, where what it checks depends on small differences of
    time (which of two equal layers a plan picks): the suite times one step of each kind (``CKPLAN_TIMING_RUNS``)."""
    from planner.profiling import timing

    monkeypatch.setattr(timing, "SET_RUNS", None)
    monkeypatch.setattr(timing, "TIMING_RUNS", 3)


@functools.cache
def random_graph(n: int, seed: int, skips: bool = False) -> tuple:
    """The memory model of ``random_profile(n, seed)`` and its ``PlanTable`` (every plan simulated once): brute
    force that the budgets of a test, and the solvers compared in one file, share."""
    from planner.memory.synthetic import PlanTable, memory_model, random_profile

    model = memory_model(random_profile(n, seed, skip_connections=skips))
    return model, PlanTable.of(model)


_PREPARED: dict = {}


def prepared_once(key: str, build):
    """``(model, inputs, loss_fn, Prepared)`` of ``build() -> (model, inputs, loss_fn)``, captured and profiled once
    per ``key`` in this worker: the budgets of a test plan one profile (``optimize`` is ``prepare`` then
    ``plan_for``, so each plan is the one ``optimize`` returns)."""
    from planner import prepare

    if key not in _PREPARED:
        model, inputs, loss_fn = build()
        _PREPARED[key] = (model, inputs, loss_fn, prepare(model, inputs=inputs, loss_fn=loss_fn))
    return _PREPARED[key]


def plan_at(prepared, budget):
    """``plan_for(prepared, budget)``; ``"smallest"``: at the smallest peak the infeasible budget of 1 byte names."""
    from planner import InfeasibleBudget, plan_for

    if budget == "smallest":
        with pytest.raises(InfeasibleBudget) as info:
            plan_for(prepared, 1)
        budget = info.value.min_peak_bytes
    return plan_for(prepared, budget)


def load_example(name: str) -> dict:
    """Runs ``examples/<name>.py`` and returns its namespace (model, inputs, loss_fn)."""
    return runpy.run_path(str(EXAMPLES / f"{name}.py"))


def training_step(module: torch.nn.Module, model: torch.nn.Module, inputs, loss_fn, *, seed: int = 0):
    """One step of ``module`` (which shares parameters and buffers with ``model``).

    Restores ``model``'s buffers and clears gradients first, so steps of the original and the
    planned module start from the same state. Returns (output, {param: grad}, {buffer: value}).
    """
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(seed)
    args, kwargs = (inputs, {}) if isinstance(inputs, tuple) else ((), inputs)
    output = module(*args, **kwargs)
    loss_fn(output).backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    for p in model.parameters():
        p.grad = None
    return output, grads, buffers


def greedy_generations(planned: torch.nn.Module, model: torch.nn.Module, prompt: dict) -> tuple:
    """``generate()`` of the planned module and of the model, greedy, 4 new tokens, both in eval mode for it
    and back in training mode after."""
    model.eval(), planned.eval()
    try:
        return (planned.generate(**prompt, max_new_tokens=4, do_sample=False),
                model.generate(**prompt, max_new_tokens=4, do_sample=False))
    finally:
        model.train(), planned.train()


def assert_plan_is_exact(model, plan, inputs, loss_fn, restore) -> None:
    """The planned module matches the model (outputs, every gradient, buffers after a step), its
    measured peak fits the budget, and the prediction is within 10% of the measurement."""
    from planner.capture.inputs import as_inputs
    from planner.profiling.measure import measure_peak

    restore(model)
    expected = training_step(model, model, inputs, loss_fn, seed=7)
    restore(model)
    actual = training_step(plan.module, model, inputs, loss_fn, seed=7)
    restore(model)
    torch.testing.assert_close(loss_fn(actual[0]), loss_fn(expected[0]), rtol=1e-4, atol=1e-5)
    assert actual[1].keys() == expected[1].keys() == {n for n, p in model.named_parameters() if p.requires_grad}
    for key in expected[1]:
        torch.testing.assert_close(actual[1][key], expected[1][key], rtol=1e-4, atol=1e-5, msg=key)
    for key in expected[2]:  # BatchNorm statistics updated exactly once
        torch.testing.assert_close(actual[2][key], expected[2][key], rtol=0, atol=0, msg=key)
    assert list(plan.module.state_dict()) == list(model.state_dict())
    measured = measure_peak(plan.module, as_inputs(model, inputs), loss_fn)
    assert measured <= plan.budget_bytes
    assert abs(plan.predicted_peak_bytes - measured) <= 0.10 * measured


@pytest.fixture
def restore_buffers():
    """Snapshots a model's buffers; call the returned function with the model to restore them."""
    saved = {}

    def snapshot_or_restore(model: torch.nn.Module) -> None:
        if id(model) not in saved:
            saved[id(model)] = [(b, b.detach().clone()) for b in model.buffers()]
        else:
            with torch.no_grad():
                for b, v in saved[id(model)]:
                    b.copy_(v)

    return snapshot_or_restore
