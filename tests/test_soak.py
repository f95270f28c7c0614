"""A soak: 200 AdamW steps of a planned model next to the unplanned one, with an eval forward and a
state_dict save/load round trip half-way. Losses, BatchNorm statistics and parameters stay bit for bit
equal, the measured peak of a step does not move and fits the budget, no tensors pile up, and the same
modules are re-run in every step. Once for each way a plan runs: a rewritten torch.fx graph, and the
model's own forward with module hooks (a value-dependent branch torch.fx cannot trace). Also: capturing
that model from a real forward leaves its BatchNorm statistics and the RNG as they were."""

import collections
import contextlib
import copy
import gc
import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import Block, Tower, tower

from planner import optimize
from planner.capture.api import capture
from planner.capture.inputs import as_inputs
from planner.capture.method import CaptureMethod
from planner.profiling.measure import measure_peak

STEPS, MIDDLE = 200, 100
ADAMW = dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.05)


class BranchyBlock(Block):
    """``models.Block`` with a branch on a tensor's value between its layers."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.fc1(x))
        h = F.gelu(h) if h.abs().sum() >= 0 else torch.tanh(h)  # always taken; torch.fx cannot trace it
        return x + self.drop(self.fc2(h))


def branchy() -> Tower:
    """``models.tower`` whose blocks branch on a value: captured from a real forward, run by hooks."""
    torch.manual_seed(0)
    return Tower(block=BranchyBlock)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of one step: 256 rows of 64 features, 10 classes."""
    generator = torch.Generator().manual_seed(10_000 + step)
    return torch.randn(256, 64, generator=generator), torch.randint(10, (256,), generator=generator)


def train_step(module: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> torch.Tensor:
    """One AdamW step on the data of ``step``; returns the loss."""
    x, y = batch(step)
    torch.manual_seed(step)  # the same dropout masks for both runs
    loss = F.cross_entropy(module(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


@contextlib.contextmanager
def forward_calls(root: nn.Module):
    """Counts the forward calls of each module of ``root`` in the block, by module path."""
    names = {id(m): name for name, m in root.named_modules()}
    calls: collections.Counter = collections.Counter()

    def count(module, args, output):
        if id(module) in names:
            calls[names[id(module)]] += 1

    handle = torch.nn.modules.module.register_module_forward_hook(count)
    try:
        yield calls
    finally:
        handle.remove()


def recomputed_modules(plan) -> set[str]:
    """Modules whose calls lie inside a checkpointed segment: the only ones a step may run twice (a
    segment's re-run stops early once it has rebuilt what backward needs, so its last ones may not)."""
    paths = [p for s in plan.segments for p in (s.chain or s.module_paths) if ":" not in p]
    return {name for name, _ in plan.module.named_modules()
            if any(name == p or name.startswith(p + ".") for p in paths)}


def step_peak(plan) -> int:
    """Measured peak bytes of one training step of the planned module (its state left as found)."""
    x, y = batch(0)
    return measure_peak(plan.module, as_inputs(plan.module, (x,)), lambda out: F.cross_entropy(out, y))


def live_tensors() -> tuple[int, int]:
    """Number of live tensor objects, and the bytes of their distinct CPU storages."""
    gc.collect()
    # type(), not isinstance(): isinstance reads __class__, which deprecated lazy objects warn about
    tensors = [t for t in gc.get_objects() if issubclass(type(t), torch.Tensor)]
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                for t in tensors if t.device.type == "cpu" and t.layout == torch.strided}
    return len(tensors), sum(storages.values())


def round_trip(module: nn.Module, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Saves the module's and the optimizer's state_dict, overwrites every parameter and buffer, loads
    the module's back, and returns a new AdamW with the optimizer's state loaded."""
    saved = io.BytesIO()
    torch.save({"model": module.state_dict(), "optimizer": optimizer.state_dict()}, saved)
    with torch.no_grad():
        for tensor in module.state_dict().values():  # detached, sharing storage with the module's
            tensor.fill_(1)
    saved.seek(0)
    state = torch.load(saved)
    module.load_state_dict(state["model"])
    optimizer = torch.optim.AdamW(module.parameters(), **ADAMW)
    optimizer.load_state_dict(state["optimizer"])
    return optimizer


def assert_same_state(a: nn.Module, b: nn.Module) -> None:
    """Every parameter and buffer (BatchNorm statistics and batch counts) equal, bit for bit."""
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name


def test_capture_from_a_real_forward_leaves_the_model_and_the_rng_alone():
    model = branchy()
    before = {name: t.clone() for name, t in model.state_dict().items()}
    rng = torch.get_rng_state()
    assert capture(model, as_inputs(model, (batch(0)[0],))).method is CaptureMethod.ATEN
    assert torch.equal(torch.get_rng_state(), rng)  # the forward's dropout draws are undone
    for name, tensor in model.state_dict().items():  # and its BatchNorm updates
        assert torch.equal(tensor, before[name]), name


@pytest.mark.slow  # 10 to 15 s per soak on one core
@pytest.mark.parametrize("make, method", [(tower, CaptureMethod.FX), (branchy, CaptureMethod.ATEN)],
                         ids=["fx-graph", "module-hooks"])
def test_200_steps_with_eval_and_state_dict_round_trip_match_the_unplanned_model(make, method):
    model = make()
    reference = copy.deepcopy(model)  # the same initial weights, trained without a plan
    x0, y0 = batch(0)
    plan = optimize(model, "60%", inputs=(x0,), loss_fn=lambda out: F.cross_entropy(out, y0))
    assert plan.segments and plan.capture_method is method
    assert {nn.BatchNorm1d, nn.Dropout} <= {type(m) for m in model.modules()}
    assert_same_state(plan.module, reference)  # planning left the weights and statistics alone

    optimizer = torch.optim.AdamW(plan.module.parameters(), **ADAMW)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), **ADAMW)
    peaks = {"step 0": step_peak(plan)}
    first_calls = None  # module path -> forward calls in the first step
    for step in range(STEPS):
        if step == MIDDLE:
            peaks["step 100"] = step_peak(plan)
            plan.module.eval(), reference.eval()
            with torch.no_grad():
                assert torch.equal(plan.module(x0), reference(x0))
            plan.module.train(), reference.train()
            assert all(m.training for m in plan.module.modules())
            optimizer = round_trip(plan.module, optimizer)
            assert_same_state(plan.module, reference)
            assert all(p is q for p, q in zip(plan.module.parameters(), model.parameters(), strict=True))
            peaks["after the load"] = step_peak(plan)

        with forward_calls(plan.module) as calls:
            loss = train_step(plan.module, optimizer, step)
        if first_calls is None:
            first_calls = dict(calls)
            assert set(first_calls.values()) == {1, 2}, first_calls
            assert {name for name, n in first_calls.items() if n == 2} <= recomputed_modules(plan)
        assert calls == first_calls, f"step {step}: the modules re-run differ from the first step's"
        expected = train_step(reference, ref_optimizer, step)
        assert torch.equal(loss, expected), f"step {step}: loss {loss.item()} != {expected.item()}"
        if step == 10:
            early = live_tensors()
    late = live_tensors()
    peaks["step 200"] = step_peak(plan)

    assert late[0] <= early[0] and late[1] <= early[1], f"(tensors, bytes) after step 10: {early}, at the end: {late}"
    assert len(set(peaks.values())) == 1 and peaks["step 0"] <= plan.budget_bytes, (peaks, plan.budget_bytes)
    assert_same_state(plan.module, reference)
    for (name, p), (_, q) in zip(plan.module.named_parameters(), reference.named_parameters(), strict=True):
        assert torch.equal(optimizer.state[p]["exp_avg_sq"], ref_optimizer.state[q]["exp_avg_sq"]), name
