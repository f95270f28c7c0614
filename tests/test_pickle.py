"""Planned modules survive ``torch.save``/``torch.load``, ``pickle`` and ``copy.deepcopy``, as checkpoint code,
multiprocessing and EMA tooling use them: the copy trains exactly as the unplanned model (loss, every gradient
and BatchNorm statistic bit for bit), still checkpoints (its backward re-runs what the original's re-runs,
selective saves included), and its plan is its own (it runs the copy's modules; ``disable(copy)`` takes it off
the copy alone). Once for each way a plan runs: a rewritten torch.fx graph, the model's own forward with module
hooks, ``enable``'s plan of the user's own object, a plan that follows the batch, and a Hugging Face model."""

from __future__ import annotations

import copy
import io
import pickle
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from forcing import every_save
from models import Block, Tower, tower, tower_inputs
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from planner import disable, enable, optimize
from planner.memory.simulate import simulate
from planner.pipeline import plan_for, plan_from_solution, prepare
from planner.solve.deadline import Deadline
from planner.solve.default import solve
from planner.solve.result import Solution

INPUTS = tower_inputs()


def loss_fn(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def _torch_save(module: nn.Module) -> nn.Module:
    saved = io.BytesIO()
    torch.save(module, saved)
    saved.seek(0)
    return torch.load(saved, weights_only=False)


ROUND_TRIPS = {"torch.save": _torch_save, "pickle": lambda module: pickle.loads(pickle.dumps(module)),
               "deepcopy": copy.deepcopy}


@dataclass(frozen=True, kw_only=True, slots=True)
class Step:
    """What one training step of a module did."""

    loss: torch.Tensor
    grads: dict[str, torch.Tensor]
    """Each parameter's gradient, by name."""
    buffers: dict[str, torch.Tensor]
    """Each buffer after the step (BatchNorm statistics), by name."""
    backward_ops: int
    """ATen ops the backward pass ran: the gradients' and those checkpointing re-runs (not those its saves keep)."""


class CountOps(TorchDispatchMode):
    """Counts the ATen ops that run under it. Ops a selective checkpoint keeps are answered from its cache
    by its own dispatch mode, above this one, and not counted: a plan with saves re-runs fewer ops than the
    same segments without (FLOPs could not tell them apart where the saves keep only ops without FLOPs).
    ``detach`` computes nothing and is not counted: how many of them checkpointing runs differs between torch
    releases (torch 2.9's cache detaches each kept output once more as it hands it back)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is not torch.ops.aten.detach.default:
            self.ops += 1
        return func(*args, **(kwargs or {}))


def step(module: nn.Module, inputs: tuple | dict = INPUTS, loss_of=loss_fn) -> Step:
    """One training step of ``module`` (dropout seeded), its gradients cleared before and after."""
    for p in module.parameters():
        p.grad = None
    torch.manual_seed(7)
    loss = loss_of(module(**inputs) if isinstance(inputs, dict) else module(*inputs))
    with CountOps() as counter:
        loss.backward()
    grads = {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}
    for p in module.parameters():
        p.grad = None
    return Step(loss=loss.detach(), grads=grads, buffers={n: b.clone() for n, b in module.named_buffers()},
                backward_ops=counter.ops)


def assert_same_training(actual: Step, expected: Step) -> None:
    """Bit for bit the same loss, gradients of every parameter and buffers after the step."""
    assert torch.equal(actual.loss, expected.loss)
    assert actual.grads.keys() == expected.grads.keys() and actual.grads
    for name, grad in expected.grads.items():
        assert torch.equal(actual.grads[name], grad), name
    assert actual.buffers.keys() == expected.buffers.keys()
    for name, buffer in expected.buffers.items():  # BatchNorm statistics updated once, not once per re-run
        assert torch.equal(actual.buffers[name], buffer), name


def plan_with_saves(model: nn.Module, budget: str):
    """A plan of ``model`` whose segments keep every op they can (selective checkpointing): the whole-segment
    plan for ``budget`` with saves forced in, and the same segments without saves."""
    prepared = prepare(model, inputs=INPUTS, loss_fn=loss_fn, time_limit_s=10)
    memory = prepared.memory
    chunks = solve(memory, plan_for(prepared, budget, selective=False).budget_bytes, deadline=Deadline.after(10)).plan
    saves = every_save(prepared.profile, memory, chunks, prepared.rules.savable)
    plans = []
    for kept in (saves, frozenset()):
        solution = Solution(plan=chunks, status="FIXED", recompute_us=0, bound_us=0, solve_time_s=0.0, saves=kept)
        plans.append(plan_from_solution(prepared, solution, simulate(memory, chunks, kept).peak_bytes))
    return plans


class BranchyBlock(Block):
    """``models.Block`` with a branch on a tensor's value: torch.fx cannot trace it, so its plan runs hooks."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.fc1(x))
        h = F.gelu(h) if h.abs().sum() >= 0 else torch.tanh(h)
        return x + self.drop(self.fc2(h))


@pytest.fixture(scope="module")
def graph_plans():
    model = tower()
    return model, *plan_with_saves(model, "50%")


@pytest.fixture(scope="module")
def hook_plans():
    torch.manual_seed(0)
    model = Tower(block=BranchyBlock)
    return model, *plan_with_saves(model, "50%")


@pytest.mark.parametrize("round_trip", ROUND_TRIPS.values(), ids=ROUND_TRIPS)
def test_a_rewritten_graph_round_trips(graph_plans, round_trip):
    model, plan, whole = graph_plans
    assert type(plan.module).__name__ == "CheckpointedTower"
    assert any(s.saved_nodes and s.restore_buffers for s in plan.segments)
    reference, copied = copy.deepcopy(model), round_trip(plan.module)  # the same weights and statistics
    assert type(copied).__name__ == "CheckpointedTower" and type(copied).__mro__[1] is Tower
    expected, actual = step(reference), step(copied)
    assert_same_training(actual, expected)
    assert all(p.grad is None for p in model.parameters())  # the copy trained its own parameters
    # it checkpoints as the original does: re-runs the segments, less the ops the saves keep
    assert expected.backward_ops < actual.backward_ops == step(plan.module).backward_ops \
        < step(whole.module).backward_ops
    assert type(round_trip(copied)).__name__ == "CheckpointedTower"  # a copy of a copy


@pytest.mark.slow  # a new interpreter imports torch and planner: about 5 s
def test_a_rewritten_graph_loads_in_a_fresh_process(graph_plans, tmp_path):
    """Loading compiles the class from the pickled source in a process that never planned: the same step."""
    model, plan, _ = graph_plans
    torch.save(plan.module, tmp_path / "planned.pt")
    expected = step(copy.deepcopy(model))
    tests = Path(__file__).parent
    script = (f"import sys; sys.path.insert(0, {str(tests)!r})\n"
              "import torch, test_pickle\n"
              f"torch.set_num_threads({torch.get_num_threads()})\n"  # the same reductions, bit for bit
              f"module = torch.load({str(tmp_path / 'planned.pt')!r}, weights_only=False)\n"
              f"torch.save(test_pickle.step(module), {str(tmp_path / 'step.pt')!r})\n")
    subprocess.run([sys.executable, "-c", script], check=True, cwd=tests.parent)
    actual = torch.load(tmp_path / "step.pt", weights_only=False)
    assert_same_training(actual, expected)
    assert actual.backward_ops == step(plan.module).backward_ops > expected.backward_ops


@pytest.mark.parametrize("round_trip", ROUND_TRIPS.values(), ids=ROUND_TRIPS)
def test_a_plan_run_by_hooks_round_trips(hook_plans, round_trip):
    model, plan, whole = hook_plans
    assert type(plan.module) is Tower and any(s.saved_ops and s.restore_buffers for s in plan.segments)
    reference, copied = copy.deepcopy(model), round_trip(plan.module)
    expected, actual = step(reference), step(copied)
    assert_same_training(actual, expected)
    assert all(p.grad is None for p in model.parameters())  # the copy's hooks re-ran the copy's modules
    planned = step(plan.module).backward_ops
    assert expected.backward_ops < actual.backward_ops == planned < step(whole.module).backward_ops
    # the copy's plan is its own: disable() takes it off the copy, and the original keeps its plan
    assert disable(copied)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in copied.modules())
    assert step(copied).backward_ops == expected.backward_ops
    assert step(plan.module).backward_ops == planned


@pytest.fixture(scope="module")
def following():
    torch.manual_seed(0)
    model = Tower(block=BranchyBlock)
    return model, optimize(model, "60%", inputs=INPUTS, loss_fn=loss_fn, time_limit_s=10, follow_batch=True)


@pytest.mark.parametrize("round_trip", ROUND_TRIPS.values(), ids=ROUND_TRIPS)
def test_a_plan_that_follows_the_batch_round_trips(following, round_trip):
    """The copy runs the groups planned so far, plans new ones (its family holds its model too) and switches its
    own modules' hooks; ``disable(copy)`` takes them off."""
    model, plan = following
    copied = round_trip(plan.module)
    reference = copy.deepcopy(model)
    expected, actual = step(reference), step(copied)
    assert_same_training(actual, expected)
    smaller = tuple(x[: len(x) // 3] for x in INPUTS)  # a group no one has planned: planned by the copy
    groups = len(plan.family.groups)
    assert_same_training(step(copied, smaller), step(reference, smaller))
    assert len(plan.family.groups) == groups  # the original's family is not the copy's
    assert all(p.grad is None for p in model.parameters())
    planned = step(plan.module).backward_ops
    assert expected.backward_ops < actual.backward_ops == planned
    assert disable(copied) and not disable(copied)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in copied.modules())
    assert step(copied).backward_ops == expected.backward_ops
    assert step(plan.module).backward_ops == planned


@pytest.fixture(scope="module")
def enabled():
    model = tower()
    reference = copy.deepcopy(model)  # before enable() plans the model in place
    plan = enable(model, "60%", inputs=INPUTS, loss_fn=loss_fn, time_limit_s=10)
    yield model, reference, plan
    disable(model)


@pytest.mark.parametrize("round_trip", ROUND_TRIPS.values(), ids=ROUND_TRIPS)
def test_a_model_enabled_in_place_round_trips(enabled, round_trip):
    model, reference, plan = enabled
    assert plan.module is model and plan.segments
    with torch.no_grad():  # the reference's statistics (an earlier test stepped the model)
        for buffer, original in zip(model.buffers(), reference.buffers(), strict=True):
            buffer.copy_(original)
    copied = round_trip(model)
    expected, actual = step(copy.deepcopy(reference)), step(copied)
    assert_same_training(actual, expected)
    assert all(p.grad is None for p in model.parameters())
    planned = step(model).backward_ops
    assert expected.backward_ops < actual.backward_ops == planned
    assert disable(copied) and not disable(copied)
    assert step(copied).backward_ops == expected.backward_ops
    assert step(model).backward_ops == planned  # the model keeps its plan


@pytest.mark.slow
def test_a_hugging_face_plan_round_trips():
    """A 2-layer Qwen2 with random weights (nothing downloaded): its own forward, hooks on its own modules."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = transformers.Qwen2ForCausalLM(config).train()
    ids = torch.randint(1, 512, (4, 64), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    plan = optimize(model, "75%", inputs=batch, time_limit_s=10)
    assert plan.segments

    def lm_loss(out) -> torch.Tensor:
        return out.loss

    for name, round_trip in ROUND_TRIPS.items():
        reference, copied = copy.deepcopy(model), round_trip(plan.module)
        assert type(copied) is type(model)
        expected, actual = step(reference, batch, lm_loss), step(copied, batch, lm_loss)
        assert_same_training(actual, expected)
        planned = step(plan.module, batch, lm_loss).backward_ops
        assert expected.backward_ops < actual.backward_ops == planned, name
        assert disable(copied) and step(copied, batch, lm_loss).backward_ops == expected.backward_ops, name
