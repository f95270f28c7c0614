"""A training step that does not fit whole where the model is: profiled in pieces that fit (memory from a
meta-tensor replay, times measured piece by piece), planned, and run, in a process capped below the plain
step; the pieces' own peak stays under the ceiling they were chosen for; the memory the pieces profile
predicts equals the whole step's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import load_example
from models import tower, tower_inputs

from planner import ProfileError, optimize, prepare
from planner.capture.inputs import as_inputs
from planner.capture.step import default_loss
from planner.memory.simulate import simulate
from planner.profiling import api
from planner.profiling.fitting import PieceSizes, choose_pieces, pieces_memory
from planner.profiling.measure import measure_peak
from planner.solve.baselines import every_block

CAPPED = Path(__file__).resolve().parent / "capped.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1",
       # glibc keeps freed memory mapped (heap fragmentation, a growing mmap threshold), so a process capped
       # by RLIMIT_AS runs out of address space long before it runs out of memory; a fixed threshold makes
       # big tensors mmapped and unmapped when freed, as a device allocator gives its memory back
       "MALLOC_MMAP_THRESHOLD_": "131072"}


def capped(what: str, growth: int, budget: int, model: str = "gpt") -> dict:
    return started(what, growth, budget, model)()


def started(what: str, growth: int, budget: int, model: str = "gpt") -> Callable[[], dict]:
    """``tests/capped.py`` started in a process of its own; call the result for its answer (runs that do not
    depend on each other go side by side)."""
    process = subprocess.Popen([sys.executable, str(CAPPED), what, str(growth), str(budget), model],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)

    def answer() -> dict:
        out, err = process.communicate(timeout=600)
        assert process.returncode == 0, err[-2000:]
        return json.loads(out.strip().splitlines()[-1])

    return answer


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gpt", "hf-gpt2"])
def test_a_model_whose_plain_step_does_not_fit_is_planned_and_trained_where_it_runs(model):
    """RLIMIT_AS between the planned step's need and the plain step's: the plain step fails, optimize returns
    a plan (profiled in pieces, never holding more than the budget), the planned step runs, and its peak is
    predicted within 1%, never under. ``hf-gpt2``: a Hugging Face model on a padded batch, whose forward reads
    the mask's values (the meta replay takes the path the real forward took), planned to follow the batch: each
    smaller shape's first call plans its group in the capped process, and every step stays in the budget."""
    plain = capped("plain", 0, 0, model)
    assert plain["ok"], plain
    cap, budget = plain["growth"] * 2 // 3, plain["growth"] // 4
    failing = started("plain", cap, 0, model)  # the plain step under the cap, beside the planned one
    planned = capped("follow" if model == "hf-gpt2" else "plan", cap, budget, model)
    failed = failing()
    assert not failed["ok"] and "can't allocate memory" in failed["error"], failed
    assert planned["ok"], planned
    assert planned["pieces"] > 1 and planned["profile_peak"] <= planned["budget"] == budget, planned
    assert planned["measured"] <= planned["budget"], planned
    assert planned["measured"] <= planned["predicted"] <= 1.01 * planned["measured"], planned
    assert planned["growth"] < cap < plain["growth"], planned
    if model == "hf-gpt2":
        steps = planned["shapes"]
        for step in steps:
            assert step["measured"] <= step["predicted"] <= planned["budget"], step
            if step["shape"] == step["group"]:  # the group's upper shape: the shape its plan was made for
                assert step["predicted"] <= 1.01 * step["measured"], step
            assert (step["segments"] == 0) == (step["baseline"] <= planned["budget"]), step
        assert steps[1]["segments"] == 0 < steps[2]["segments"], steps  # 4 x 64 fits whole; 12 x 200 does not


@pytest.mark.parametrize("name", ["gpt", "resnet"])
def test_the_pieces_profile_predicts_the_memory_of_the_whole_steps(monkeypatch, name):
    """The same model profiled whole and in pieces: the same storages, saves and per-node live bytes (but for
    what the loss does with tensors that are not the model's, e.g. reshaped targets), the same predicted
    peak for the same plan; the pieces held less than the whole step."""
    example = load_example(name)
    model, inputs, loss_fn = example["model"], example["inputs"], example["loss_fn"]
    whole = prepare(model, inputs=inputs, loss_fn=loss_fn)
    assert whole.profile.pieces == 1 and whole.profile.profile_peak_bytes == whole.profile.baseline_peak_bytes
    monkeypatch.setattr(api, "headroom_bytes", lambda device: whole.profile.baseline_peak_bytes * 9 // 10)
    pieces = prepare(model, inputs=inputs, loss_fn=loss_fn)
    a, b = whole.profile, pieces.profile
    assert b.pieces > 1 and b.profile_peak_bytes < a.profile_peak_bytes
    fields = ("name", "fwd_start_bytes", "fwd_peak_bytes", "bwd_start_bytes", "bwd_peak_bytes", "inputs", "outputs",
              "saves", "mutates", "eager_excess_bytes", "stop_peak_bytes", "aten_ops", "mutated_buffers")
    for x, y in zip(a.nodes[:-1], b.nodes[:-1]):
        assert [getattr(x, f) for f in fields] == [getattr(y, f) for f in fields], x.name
    assert abs(a.nodes[-1].fwd_peak_bytes - b.nodes[-1].fwd_peak_bytes) <= 64 * 1024  # the loss's own tensors
    assert a.baseline_peak_bytes == b.baseline_peak_bytes and a.grad_bytes == b.grad_bytes
    plan = every_block(whole.memory, 0).plan
    assert simulate(whole.memory, plan).peak_bytes == simulate(pieces.memory, plan).peak_bytes


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt", "resnet", "mixer"])
def test_pieces_hold_no_more_than_the_ceiling_they_were_chosen_for(name):
    """``PieceSizes`` is an upper estimate: a step run in the chosen pieces, measured, stays under it."""
    example = load_example(name)
    model, inputs, loss_fn = example["model"], example["inputs"], example.get("loss_fn")
    prepared = prepare(model, inputs=inputs, loss_fn=loss_fn)
    sizes = PieceSizes(prepared.profile)
    for share in (0.6, 0.8):  # ResNet's largest node (a convolution's backward and its reorders) needs 0.51
        ceiling = int(prepared.profile.baseline_peak_bytes * share)
        pieces = choose_pieces(prepared.profile, ceiling)
        assert len(pieces) > 1
        peak = pieces_memory(prepared.captured, model, as_inputs(model, inputs), pieces=pieces,
                             loss_fn=loss_fn or default_loss, device=torch.device("cpu")).peak_bytes
        assert peak <= max(sizes.bytes(lo, hi) for lo, hi in pieces) <= ceiling, (share, peak)


def test_a_node_too_big_for_the_device_is_named_with_the_way_out():
    prepared = prepare(tower(), inputs=tower_inputs())
    with pytest.raises(ProfileError, match=r"alone needs about .* more than the .*\(profile=\) or .*\(device=\)"):
        choose_pieces(prepared.profile, prepared.profile.param_bytes)


def test_a_budget_bounds_the_pieces_when_they_fit_in_it(monkeypatch):
    """Profiling in pieces for ``optimize(model, budget)`` holds no more than the budget."""
    model, inputs = tower(), tower_inputs()
    whole = prepare(model, inputs=inputs).profile
    monkeypatch.setattr(api, "headroom_bytes", lambda device: whole.baseline_peak_bytes)  # pieces fit the device
    monkeypatch.setattr(api, "FIT_SHARE", 0.5)  # ... but not the whole step
    plan = optimize(model, "70%", inputs=inputs, selective=False)
    assert plan.profile_pieces > 1 and plan.profile_peak_bytes <= plan.budget_bytes
    assert measure_peak(plan.module, as_inputs(model, inputs), default_loss) <= plan.budget_bytes
