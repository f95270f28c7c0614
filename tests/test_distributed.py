"""Plans for one rank of an FSDP2 or DDP job: the per-rank memory model, and 2-rank gloo training runs.

The multi-process tests spawn 2 ranks on 127.0.0.1 and fail (instead of hanging) after a timeout. Full-suite runs
have lost a rank to SIGABRT now and then ("terminate called without an active exception": a ``std::thread``
destroyed while joinable, the signature of C++ teardown at process exit), in tests that pass alone. So each rank
dumps its Python stacks if it dies of a signal (``faulthandler``: where it was, should one die mid-run), and ends in
``finish_rank``: its result written, every rank past a barrier, the process group destroyed, then ``os._exit(0)``,
skipping the exit-time teardown of gloo's and the profiler's C++ state; nothing a test checks happens after it. A
rank that raises ends the same way (``_guarded``: its traceback, then ``os._exit(1)``). The message was reproduced
only in an interpreter's shutdown (a native thread that finishes while Python shuts down: a CP-SAT solve of 8
workers left running in a daemon thread aborted 6 times of 6), which neither ending goes through; ckplan's solves
never outlive ``planner.solve.cpsat.run``.
"""

from __future__ import annotations

import faulthandler
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from conftest import load_example
from offloading import offloaded_plan

from planner import InfeasibleBudget, load_plan, plan_for, prepare
from planner.capture.fsdp_units import resolve_units
from planner.distributed.memory import memory_offset, setup, split_at_units
from planner.distributed.rank import (
    apply_plan,
    count_collectives,
    fully_shard_units,
    plan_on_rank0,
    rank_peak_bytes,
    resident_bytes,
    same_on_all_ranks,
)
from planner.memory.build import build_model
from planner.plan import Segment
from planner.rewrite.offload import offloader_of
from planner.solve.deadline import Deadline
from planner.solve.result import Solution

WIDTH, DEPTH, ROWS = 64, 4, 1024
UNITS = [f"blocks.{i}" for i in range(DEPTH)]


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(WIDTH) for _ in range(DEPTH))
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_model() -> Net:
    torch.manual_seed(0)
    return Net()


def rank_inputs(rank: int) -> torch.Tensor:
    return torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(rank))


def loss_fn(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


# ---- the per-rank memory model, on one process ------------------------------------------------

@pytest.fixture(scope="module")
def fsdp_prepared():
    """One FSDP2 rank as planned: the model's own forward (module hooks), so FSDP2's hooks run."""
    return prepare(make_model(), inputs=(rank_inputs(0),), loss_fn=loss_fn, world_size=2, optimizer="adamw")


@pytest.fixture(scope="module")
def units_prepared():
    """The same rank captured with its units as calls: the tier a saved plan of an FSDP job falls to without
    example inputs (each unit one node, so the per-rank memory model can be checked unit by unit)."""
    from planner.capture.api import capture
    from planner.capture.inputs import as_inputs
    from planner.options import PlanOptions
    from planner.planning.prepared import prepared_from
    from planner.profiling.api import profile_for
    from planner.profiling.optimizer import optimizer_state

    model = make_model()
    options = PlanOptions(loss_fn=loss_fn, world_size=2, optimizer="adamw")
    job = setup(model, world_size=2)
    assert job is not None
    captured = capture(model, units=job.opaque)
    example = as_inputs(model, (rank_inputs(0),))
    profile = profile_for(captured, model, example, loss_fn=loss_fn)
    loop = options.loop(optimizer=optimizer_state("adamw", model, device_type="cpu", shards=2), autocast=None)
    return prepared_from(model, example, captured, profile, options=options, loop=loop, distributed=job)


@pytest.mark.parametrize("kwargs, message", [
    ({"world_size": 0}, "world_size must be an integer >= 1"),
    ({"world_size": 1.5}, "world_size must be an integer >= 1"),
    ({"world_size": 2, "parallel": "zero3"}, "unknown parallel='zero3'"),
    ({"world_size": 2, "units": ["blocks.9"]}, "unit 'blocks.9' matches no submodule of Net"),
    ({"world_size": 2, "units": ["blocks.*", "blocks.1.fc1"]}, "unit 'blocks.1.fc1' is inside unit 'blocks.1'"),
    ({"world_size": 2, "parallel": "ddp", "units": ["blocks.*"]}, "units= names FSDP units"),
])
def test_bad_arguments_say_what_to_do(kwargs, message):
    with pytest.raises(ValueError, match=message):
        setup(make_model(), **kwargs)


def test_units_default_to_the_repeated_blocks_and_accept_globs():
    model = make_model()
    assert resolve_units(model, None) == tuple(UNITS)
    assert resolve_units(model, ["blocks.*"]) == tuple(UNITS)
    assert resolve_units(model, "blocks.[02]") == ("blocks.0", "blocks.2")
    assert setup(model) is None  # one device: the plain model


def test_fsdp_offset_matches_the_hand_computed_model(units_prepared):
    """Net: 4 blocks of 132352 parameter bytes and a head (root unit) of 16640; 2 ranks; AdamW, whose state
    (sharded, and a float32 ``step`` per parameter on this CPU) is the loop's, counted once on top."""
    block, head, n = 132352, 16640, 2
    total = DEPTH * block + head
    resident = total // n - total                           # shards - full params
    offset = memory_offset(units_prepared.profile, units_prepared.distributed)
    state = units_prepared.loop.optimizer.state_bytes
    steps = 4 * len(list(make_model().parameters()))
    assert state == 2 * total // n + steps // n
    memory = units_prepared.memory  # the loop's state on every node, forward and backward
    rank_only = build_model(units_prepared.profile, units_prepared.regions, offset=offset,
                            sac_op_us=units_prepared.sac_cost.op_us, sac_host_us=units_prepared.sac_cost.host_us)
    assert (memory.const_fwd - rank_only.const_fwd == state).all()
    names = [node.name for node in units_prepared.profile.nodes]
    assert names == ["blocks_0", "blocks_1", "blocks_2", "blocks_3", "head", "loss"]
    # forward: root + current unit + max(its all-gather buffer, the next unit prefetched)
    assert offset.fwd_bytes.tolist() == [resident + head + 2 * block] * 4 + [resident + head] * 2
    # backward at blocks.1: blocks.3 reduced to a shard, blocks.2's reduce-scatter in flight (+1/N)
    assert offset.bwd_bytes[1] == resident + head + 2 * block - block // n + block // n
    assert offset.bwd_bytes[0] == resident + head + 2 * block - 2 * block // n + block // n
    assert offset.bwd_bytes[3] == resident + head + 2 * block
    assert offset.param_bytes == units_prepared.profile.param_bytes - total + total // n


def test_ddp_offset_is_replicas_plus_buckets_plus_optimizer(units_prepared):
    from planner.common.loop import TrainingLoop
    from planner.memory.offset import combined, loop_offset
    from planner.profiling.optimizer import optimizer_state

    model = make_model()
    ddp = setup(model, world_size=2, parallel="ddp")
    offset = memory_offset(units_prepared.profile, ddp)
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    assert set(offset.fwd_bytes.tolist()) == set(offset.bwd_bytes.tolist()) == {grads}  # the gradient buckets
    loop = TrainingLoop(optimizer=optimizer_state(12345, model, device_type="cpu"))  # one device: the state only
    single = loop_offset(units_prepared.profile, loop)
    assert set(single.fwd_bytes.tolist()) == set(single.bwd_bytes.tolist()) == {12345}
    both = combined(single, offset, units_prepared.memory.has_bwd)
    assert set(both.fwd_bytes.tolist()) == {grads + 12345}


def test_segments_are_cut_to_one_unit_each(units_prepared):
    memory = units_prepared.memory
    joint = Solution(plan=((0, 3),), status="OPTIMAL", recompute_us=0, bound_us=0, solve_time_s=0.0)
    cut = split_at_units(memory, joint, 10**12, units_prepared.distributed, units_prepared.profile,
                         deadline=Deadline.after(30))
    assert cut.plan == ((0, 1), (1, 2), (2, 3))
    with pytest.raises(InfeasibleBudget):
        split_at_units(memory, joint, 1000, units_prepared.distributed, units_prepared.profile,
                       deadline=Deadline.after(30))


def test_fsdp_plans_run_the_models_own_forward_inside_units_and_keep_ops(fsdp_prepared):
    """Under FSDP the plan runs the model's own forward (FSDP2's hooks run): segments are chains of module
    calls that re-run at most one unit, and may lie inside one and keep any op there."""
    assert fsdp_prepared.captured.method.value == "aten"
    plan = plan_for(fsdp_prepared, "90%", must_save=["*gelu*"])
    assert plan.segments and plan.predicted_peak_bytes <= plan.budget_bytes
    for seg in plan.segments:
        assert len({u for u in UNITS for m in seg.chain if m == u or m.startswith(u + ".")}) <= 1, seg.chain
    assert any(seg.saved_ops for seg in plan.segments)
    assert all(name.startswith("aten.gelu") for seg in plan.segments for name, _ in seg.saved_ops)


def test_fsdp_plan_calls_whole_units(units_prepared, tmp_path):
    plan = plan_for(units_prepared, "60%")
    assert plan.segments and plan.predicted_peak_bytes <= plan.budget_bytes
    for seg in plan.segments:  # each segment re-runs whole unit calls, at most one
        assert sum(p in UNITS for p in seg.module_paths) <= 1
    assert "fc1" not in plan.source  # blocks are called (FSDP2's hooks fire), never inlined
    assert early_gathers(plan.segments, UNITS) == 0
    plan.save(tmp_path / "plan.json")
    rebuilt = apply_plan(load_plan(tmp_path / "plan.json"), make_model())
    assert type(rebuilt).__name__ == type(plan.module).__name__
    with pytest.raises(ValueError, match="pass the units= the plan was made with"):
        apply_plan(plan, make_model(), units=["blocks.0", "blocks.1"])


def test_plan_on_rank0_needs_a_process_group():
    with pytest.raises(RuntimeError, match="call dist.init_process_group"):
        plan_on_rank0(make_model(), "60%", inputs=(rank_inputs(0),))


def early_gathers(segments, units) -> int:
    """Units a plan's re-runs gather before their own backward, per step (FSDP2): in each segment
    every unit but the last, and the last too when ops follow it in the segment. Each stays
    gathered until its post-backward; the number of all-gathers does not change. Conservative:
    an op after the last unit that saves nothing does not start the re-run early."""
    wanted = set(units)
    early = 0
    for seg in segments:
        paths = list(seg.module_paths)
        inside = [i for i, p in enumerate(paths) if p in wanted]
        if inside:
            early += len(inside) - 1 + (1 if inside[-1] < len(paths) - 1 else 0)
    return early


def test_early_gathers_counts_units_re_run_before_their_backward():
    def seg(*paths):
        return Segment(nodes=(), module_paths=paths, recompute_ms=0.0)
    assert early_gathers([seg("blocks.0"), seg(":relu", "blocks.1")], UNITS) == 0
    assert early_gathers([seg("blocks.0", "blocks.1", "blocks.2")], UNITS) == 2
    assert early_gathers([seg("blocks.3", "head")], UNITS) == 1


@pytest.mark.slow
def test_cli_plans_one_rank(tmp_path):
    model_file = tmp_path / "model.py"
    model_file.write_text(f"import sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
                          "from test_distributed import make_model as model, rank_inputs, loss_fn\n"
                          "inputs = (rank_inputs(0),)\n")

    def ckplan(*args):
        return subprocess.run([sys.executable, "-m", "planner", str(model_file), *args], capture_output=True,
                              text=True, timeout=120)

    done = ckplan("--budget", "60%", "--world-size", "2", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["capture_method"] == "aten"  # the model's own forward, so FSDP2's hooks run
    assert report["segments"] and all(len({m.split(".")[1] for m in s["chain"] if m.startswith("blocks.")}) <= 1
                                      for s in report["segments"])
    bad = ckplan("--world-size", "0")
    assert bad.returncode == 2 and "--world-size must be an integer >= 1" in bad.stderr


# ---- 2 ranks, gloo, loopback ------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(worker, out_dir: Path, *, world_size: int = 2, timeout_s: float = 150.0) -> list[dict]:
    """Runs ``worker(rank, world_size, port, out_dir)`` on spawned ranks (``_guarded``); each writes rank<r>.json."""
    ctx = mp.start_processes(_guarded, args=(worker, world_size, _free_port(), str(out_dir)), nprocs=world_size,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for process in ctx.processes:
                process.kill()
            pytest.fail(f"the {world_size} ranks did not finish within {timeout_s:.0f} s (a hang)")
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]


def _guarded(rank: int, worker, *args) -> None:
    """``worker(rank, *args)``; a rank that raises prints its traceback and ends with ``os._exit(1)``, not through
    the interpreter's shutdown (torch's spawn wrapper would ``sys.exit(1)``), where gloo's threads or a native
    thread still finishing can end the process in ``std::terminate`` and hide the error behind a SIGABRT."""
    try:
        worker(rank, *args)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def _init(rank: int, world_size: int, port: int) -> None:
    faulthandler.enable(all_threads=True)  # a rank that dies of a signal says where it was
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def finish_rank(out_dir: str, rank: int, result: dict) -> None:
    """Ends a rank: ``result`` written as ``rank<r>.json``, every rank past a barrier (none tears down while another
    still runs collectives), the process group destroyed, and the process gone with ``os._exit(0)`` (the module
    docstring says why)."""
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _train(module: nn.Module, wrapped: nn.Module, x: Any, extra_resident: int = 0, *,
           loss_of: Callable[[nn.Module, Any], torch.Tensor] = lambda m, x: loss_fn(m(x)),
           lr: float = 1e-2, steps: int = 4) -> dict:
    """``steps`` AdamW steps of ``loss_of(wrapped, x)``: losses, all-gathers per step, the gradient norms of step 1
    and the median peak of the steps after the first, when optimizer state exists (``extra_resident``: bytes alive
    before the step that ``resident_bytes`` does not see), at the allocator. The median: on a loaded machine one
    step can read higher, where gloo's thread completes an FSDP2 reduce-scatter late (``in_flight_bytes``)."""
    opt = torch.optim.AdamW(wrapped.parameters(), lr=lr)
    losses, gathers, peaks, grads = [], [], [], []
    for step in range(steps):
        out: list[torch.Tensor] = []

        def one_step(out: list = out) -> None:
            out.append(loss_of(wrapped, x))
            out[-1].backward()

        with count_collectives() as counts:
            if step >= 1:
                peaks.append(rank_peak_bytes(one_step, resident_bytes(module, opt, x) + extra_resident))
            else:
                one_step()
        if step == 0:
            grads = [float(getattr(p.grad, "full_tensor", lambda g=p.grad: g)().double().norm())
                     for p in wrapped.parameters()]
        opt.step()
        opt.zero_grad()
        losses.append(out[-1].item())
        gathers.append(counts["all_gather_single"])
    return {"losses": losses, "all_gathers": gathers, "peak": int(statistics.median(peaks)), "grads": grads}


SMALL = 8 * 1024
"""Bytes a rank's step may allocate beyond its prediction that are not the step's tensors (4 KiB measured under
accelerate's DDP)."""


def close_to(predicted: int, measured: int, *, tolerance: float = 0.01, slack: int = SMALL, early: int = 0) -> bool:
    """A rank's predicted peak against its peak measured at the allocator (``rank_peak_bytes``): over it by at most
    ``tolerance`` of it (plus ``early``), and never under it by more than ``slack``. ``early``: what a collective
    gloo's thread runs late may leave out of the measured peak (a unit's prefetch gathered after the peak instead
    of before it, on a loaded machine)."""
    return measured - slack <= predicted <= (1 + tolerance) * measured + early


def in_flight_bytes(model: nn.Module, units: list[str] | None = None) -> int:
    """What an FSDP2 rank may hold beyond its prediction on a loaded machine: the largest unit's unsharded
    gradients, the reduce-scatter's input, which gloo's thread frees when the collective completes (measured: up
    to 86 KiB over on ``Net``, whose block's gradients are 129 KiB)."""
    modules = [model.get_submodule(path) for path in resolve_units(model, units)]
    return max(sum(p.numel() * p.element_size() for p in unit.parameters()) for unit in modules)


def _plan_record(plan) -> dict:
    return {"segments": [list(s.nodes) for s in plan.segments], "budget": plan.budget_bytes,
            "predicted": plan.predicted_peak_bytes, "baseline": plan.baseline_peak_bytes,
            "same_plan": same_on_all_ranks([s.nodes for s in plan.segments])}


def fsdp_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    _init(rank, world_size, port)
    x = rank_inputs(rank)
    result = {"in_flight": in_flight_bytes(make_model()),
              "unplanned": _train(*(2 * [fully_shard_units(make_model())]), x)}
    plan = plan_on_rank0(make_model(), "60%", inputs=(x,), loss_fn=loss_fn, optimizer="adamw", keep_output=False)
    result.update(_plan_record(plan), planned=_train(plan.module, fully_shard_units(plan.module), x))
    saving = plan_on_rank0(make_model(), "80%", inputs=(x,), loss_fn=loss_fn, optimizer="adamw", keep_output=False,
                           must_save=["*gelu*"])  # op-level saves inside the units' segments (SAC under FSDP2)
    result["saving"] = {"saves": sum(len(s.saved_nodes) for s in saving.segments), "budget": saving.budget_bytes,
                        "predicted": saving.predicted_peak_bytes,
                        **_train(saving.module, fully_shard_units(saving.module), x)}
    joint = replace(plan, segments=(Segment(nodes=(), module_paths=(), recompute_ms=0.0,
                                            chain=("blocks.0", "blocks.1", "blocks.2")),))
    result["joint"] = _train(*(2 * [fully_shard_units(apply_plan(joint, make_model()))]), x)
    result["offloading"] = _offloading(x)
    finish_rank(out_dir, rank, result)


OFFLOADING_STEPS = 6
"""Steps of the FSDP2 run with offloads, the median peak of the last 5: its synchronous copies to the CPU's host
store lengthen each step, and under a full suite's load two of steps 2-4 once read gloo's late reduce-scatters
(5,644,496 B against 5,424,556 predicted, beyond one unit's slack; alone and under a 2-process CPU hog it passed
3 times of 3)."""


def _offloading(x: torch.Tensor) -> dict:
    """A plan with offloads to the CPU's tagged host store (``offload=`` refuses a CPU), made on rank 0 at 60% of
    the peak and offloaded below it, applied on every rank and trained under FSDP2."""
    payload: list[Any] = [None]
    if dist.get_rank() == 0:
        prepared = prepare(make_model(), inputs=(x,), loss_fn=loss_fn, world_size=2, optimizer="adamw",
                           keep_output=False)
        payload[0] = replace(offloaded_plan(prepared, 0.6, min_bytes=ROWS * WIDTH * 4), module=None)
    dist.broadcast_object_list(payload, src=0)
    plan = payload[0]
    module = plan.apply(make_model(), inputs=(x,), loss_fn=loss_fn)
    offloader = offloader_of(module)
    trained = _train(module, fully_shard_units(module), x, steps=OFFLOADING_STEPS)
    return {"budget": plan.budget_bytes, "predicted": plan.predicted_peak_bytes, "missed": offloader.missed,
            "offloaded": plan.offload.offloaded_bytes, "host_peak": offloader.host_peak_bytes,
            "same_plan": same_on_all_ranks([s.nodes for s in plan.segments]), **trained}


def ddp_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    _init(rank, world_size, port)
    x = rank_inputs(rank)
    buckets = sum(p.numel() * p.element_size() for p in make_model().parameters())  # allocated at DDP(...)
    result = {"in_flight": 0, "unplanned": _train((model := make_model()), DDP(model), x, buckets)}
    plan = plan_on_rank0(make_model(), "60%", inputs=(x,), loss_fn=loss_fn, parallel="ddp", optimizer="adamw",
                         keep_output=False)
    result.update(_plan_record(plan), planned=_train(plan.module, DDP(plan.module), x, buckets))
    saving = plan_on_rank0(make_model(), "80%", inputs=(x,), loss_fn=loss_fn, parallel="ddp", optimizer="adamw",
                           keep_output=False, must_save=["*gelu*"])  # op-level saves inside the segments (SAC)
    result["saving"] = {"saves": sum(len(s.saved_nodes) for s in saving.segments), "budget": saving.budget_bytes,
                        "predicted": saving.predicted_peak_bytes,
                        **_train(saving.module, DDP(saving.module), x, buckets)}
    try:
        plan_on_rank0(make_model(), "1KB", inputs=(x,), loss_fn=loss_fn, parallel="ddp")
    except InfeasibleBudget as exc:  # raised on every rank, not only where it was planned
        result["infeasible"] = exc.min_peak_bytes
    finish_rank(out_dir, rank, result)


def _check_ranks(results: list[dict]) -> None:
    for r in results:
        assert r["same_plan"] and r["segments"] == results[0]["segments"] and r["segments"]
        torch.testing.assert_close(r["planned"]["losses"], r["unplanned"]["losses"], rtol=1e-5, atol=1e-7)
        late = SMALL + r["in_flight"]  # measured on this rank, steps 2-4; the loop drops the output (keep_output=False)
        assert r["planned"]["peak"] <= r["budget"] + late, r
        assert close_to(r["predicted"], r["planned"]["peak"], slack=late), r
        assert close_to(r["baseline"], r["unplanned"]["peak"], slack=late), r
        saving = r["saving"]  # a plan with op-level saves: the same training, within its budget and prediction
        assert saving["saves"] > 0 and saving["peak"] <= saving["budget"] + late, saving
        assert close_to(saving["predicted"], saving["peak"], slack=late), saving
        assert saving["grads"] == r["unplanned"]["grads"]
        torch.testing.assert_close(saving["losses"], r["unplanned"]["losses"], rtol=1e-5, atol=1e-7)
    assert results[0]["unplanned"]["losses"] != results[1]["unplanned"]["losses"]  # ranks saw different data


@pytest.mark.slow
def test_fsdp2_planned_module_trains_like_the_unplanned_one(tmp_path):
    results = run_ranks(fsdp_worker, tmp_path)
    _check_ranks(results)
    for r in results:
        # 5 units gathered in forward, 4 again in backward (the root stays gathered): the plan and a
        # 3-unit segment add none (FSDP2 keeps a unit re-run in backward gathered until its backward)
        assert r["unplanned"]["all_gathers"] == r["planned"]["all_gathers"] == [2 * DEPTH + 1] * 4
        assert r["joint"]["all_gathers"] == [2 * DEPTH + 1] * 4
        torch.testing.assert_close(r["joint"]["losses"], r["unplanned"]["losses"], rtol=1e-5, atol=1e-7)
        offloading = r["offloading"]  # copies out in forward, back in backward, per rank
        assert offloading["same_plan"] and offloading["missed"] == 0
        assert offloading["host_peak"] == offloading["offloaded"] > 0
        assert offloading["all_gathers"] == [2 * DEPTH + 1] * OFFLOADING_STEPS  # offloads add no collective
        assert offloading["grads"] == r["unplanned"]["grads"]
        torch.testing.assert_close(offloading["losses"][:4], r["unplanned"]["losses"], rtol=1e-5, atol=1e-7)
        late = SMALL + r["in_flight"]  # the host store is not the device's memory: uncounted
        assert offloading["peak"] <= offloading["budget"] + late, offloading
        assert close_to(offloading["predicted"], offloading["peak"], slack=late), offloading


@pytest.mark.slow
def test_ddp_planned_module_trains_like_the_unplanned_one(tmp_path):
    results = run_ranks(ddp_worker, tmp_path)
    _check_ranks(results)
    assert results[0]["infeasible"] == results[1]["infeasible"] > 1000


SUB_BLOCK_UNITS = ["blocks.*.attn", "blocks.*.mlp"]


def sub_block_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """The GPT example sharded by its blocks' attention and MLP, so that a chain's later member (``ln_2`` then
    ``mlp``) is an FSDP2 unit, whose pre-hook hands it a view of ``ln_2``'s output; unplanned, then planned on
    rank 0 at 60%, each trained 4 steps from the same seed (dropout draws alike)."""
    _init(rank, world_size, port)
    example = load_example("gpt")
    tokens, loss_of = example["inputs"][0], lambda m, x: example["loss_fn"](m(x))
    torch.manual_seed(0)
    unplanned = _train(example["model"], fully_shard_units(example["model"], SUB_BLOCK_UNITS), tokens, loss_of=loss_of)
    fresh = load_example("gpt")
    plan = plan_on_rank0(fresh["model"], "60%", inputs=fresh["inputs"], loss_fn=fresh["loss_fn"], optimizer="adamw",
                         units=SUB_BLOCK_UNITS, keep_output=False, time_limit_s=20)
    torch.manual_seed(0)
    planned = _train(plan.module, fully_shard_units(plan.module, SUB_BLOCK_UNITS), tokens, loss_of=loss_of)
    finish_rank(out_dir, rank, {"unplanned": unplanned, "planned": planned, "budget": plan.budget_bytes,
                                "predicted": plan.predicted_peak_bytes,
                                "chains": [list(s.chain) for s in plan.segments],
                                "in_flight": in_flight_bytes(load_example("gpt")["model"], SUB_BLOCK_UNITS)})


@pytest.mark.slow
def test_a_chain_whose_later_member_is_an_fsdp_unit_keeps_none_of_its_inputs(tmp_path):
    """FSDP2's pre-hook runs before ckplan's and hands the unit a view of the chain's earlier output: the chain
    records it as that output, not as a tensor to keep (which held each such input, 0.5 MiB a chain here, past
    the budget at the allocator). Each rank's peak within the budget and 1% of the prediction, the unplanned
    job's losses."""
    for r in run_ranks(sub_block_worker, tmp_path, timeout_s=300):
        assert any(len(chain) > 1 and chain[-1].endswith((".attn", ".mlp")) for chain in r["chains"]), r["chains"]
        torch.testing.assert_close(r["planned"]["losses"], r["unplanned"]["losses"], rtol=1e-5, atol=1e-7)
        late = SMALL + r["in_flight"]
        assert r["planned"]["peak"] <= r["budget"] + late, r
        assert close_to(r["predicted"], r["planned"]["peak"], slack=late), r
