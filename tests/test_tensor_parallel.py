"""A model the user parallelised with ``parallelize_module`` (tensor parallelism, DTensor parameters), planned
per rank on 2 gloo ranks: every rank profiles it together (its forward runs all-reduces), rank 0 solves, every
rank runs that one plan. Memory counts each rank's local shards and what TP's collectives allocate."""

from __future__ import annotations

import time

import pytest
import torch
from test_distributed import _init, finish_rank, run_ranks
from torch import nn

pytestmark = pytest.mark.slow  # spawns gloo ranks

WIDTH, HIDDEN, DEPTH = 128, 512, 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.act = nn.GELU()
        self.down = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def loss_fn(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def tensor_parallel(mesh) -> Net:
    """The model, its up projections column-wise and its down projections row-wise over ``mesh``."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    plan = {f"blocks.{i}.{name}": style for i in range(DEPTH)
            for name, style in (("up", ColwiseParallel()), ("down", RowwiseParallel()))}
    return parallelize_module(Net(), mesh, plan)


def step(module: nn.Module, x: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
    """Loss and each parameter's local gradient after one step."""
    from planner.profiling.memtrack import local_of

    for p in module.parameters():
        p.grad = None
    loss = loss_fn(module(x))
    loss.backward()
    grads = [local_of(p.grad).clone() for p in module.parameters()]
    for p in module.parameters():
        p.grad = None
    return loss.item(), grads


def tp_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from planner.capture.inputs import as_inputs
    from planner.distributed.rank import plan_on_rank0, same_on_all_ranks
    from planner.profiling.measure import measure_peak
    from planner.profiling.timing import Timer

    _init(rank, world_size, port)
    mesh = init_device_mesh("cpu", (world_size,))
    x = torch.randn(8, 128, WIDTH, generator=torch.Generator().manual_seed(0))  # TP: every rank the same batch
    if rank == 1:  # this rank times its nodes far slower: a plan of its own would differ from rank 0's
        timed = Timer.around_node

        def slow(self, index, node, compute, values):
            def later():  # some nodes a few ms slower, no op more (an op more would be a collective more)
                out = compute()
                time.sleep(0.002 * (index % 4))
                return out
            return timed(self, index, node, later, values)

        Timer.around_node = slow
        from planner.profiling import cores  # and sees the machine busy (more steps if it timed by its own load)
        cores.free_cores = lambda window_s=0.2: 0.0
    reference = tensor_parallel(mesh)
    expected = step(reference, x)
    plan = plan_on_rank0(tensor_parallel(mesh), "80%", inputs=(x,), loss_fn=loss_fn, time_limit_s=20)
    actual = step(plan.module, x)
    peak = measure_peak(plan.module, as_inputs(plan.module, (x,)), loss_fn)
    result = {"segments": [list(s.nodes) for s in plan.segments], "same_plan": same_on_all_ranks(
        [s.nodes for s in plan.segments]), "budget": plan.budget_bytes, "predicted": plan.predicted_peak_bytes,
        "baseline": plan.baseline_peak_bytes, "peak": peak,
        "unplanned_peak": measure_peak(reference, as_inputs(reference, (x,)), loss_fn),
        "same_loss": actual[0] == expected[0],
        "same_grads": all(torch.equal(a, b) for a, b in zip(actual[1], expected[1]))}
    finish_rank(out_dir, rank, result)


def test_a_tensor_parallel_model_runs_one_plan_on_every_rank_within_its_budget(tmp_path):
    """Rank 1 times its nodes slower than rank 0 and finds the machine busy, yet both run rank 0's plan (no
    hang: a timeout fails the test); each rank's gradients equal the unplanned TP job's; each rank's measured
    peak (its local shards, its all-reduces' buffers) is within the budget and predicted to within 1%, never
    under."""
    results = run_ranks(tp_worker, tmp_path, timeout_s=300)
    # all-reduced activations gloo's thread holds past their last use: the allocator sees up to two or three of them
    # (1.3 MiB measured here over 10.5 predicted; docs/limits.md), which no model of the step's ops predicts
    held = 3 * 8 * 128 * WIDTH * 4
    for r in results:
        assert r["segments"] and r["same_plan"] and r["segments"] == results[0]["segments"], r
        assert r["same_loss"] and r["same_grads"], r
        assert r["peak"] <= r["budget"] + held, r
        assert r["peak"] - held <= r["predicted"] <= 1.01 * r["peak"], r
        assert r["unplanned_peak"] - held <= r["baseline"] <= 1.01 * r["unplanned_peak"], r


def _fsdp_tp_train(module: nn.Module, x: torch.Tensor, mesh) -> dict:
    """``module`` sharded over the mesh's ``dp`` ranks (each block, then the root), 3 AdamW steps: losses, the
    local gradients of step 1, the peak of step 2 at the allocator."""
    from planner.distributed.rank import fully_shard_units, rank_peak_bytes, resident_bytes
    from planner.profiling.memtrack import local_of

    fully_shard_units(module, mesh=mesh["dp"])
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
    losses, grads, peak = [], [], 0
    for i in range(3):
        out: list[torch.Tensor] = []

        def one(out: list = out) -> None:
            out.append(loss_fn(module(x)))
            out[-1].backward()

        if i == 1:
            peak = rank_peak_bytes(one, resident_bytes(module, opt, x))
        else:
            one()
        if i == 0:
            grads = [float(local_of(p.grad).double().norm()) for p in module.parameters()]
        opt.step()
        opt.zero_grad()
        losses.append(out[-1].item())
    return {"losses": losses, "grads": grads, "peak": peak}


def fsdp_tp_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from planner.distributed.rank import plan_on_rank0, same_on_all_ranks

    _init(rank, world_size, port)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x = torch.randn(8, 128, WIDTH, generator=torch.Generator().manual_seed(mesh["dp"].get_local_rank()))
    result = {"unplanned": _fsdp_tp_train(tensor_parallel(mesh["tp"]), x, mesh)}
    plan = plan_on_rank0(tensor_parallel(mesh["tp"]), "80%", inputs=(x,), loss_fn=loss_fn, optimizer="adamw",
                         keep_output=False, time_limit_s=20)
    result.update(segments=[list(s.nodes) for s in plan.segments], budget=plan.budget_bytes,
                  predicted=plan.predicted_peak_bytes, world_size=plan.peak_breakdown is not None,
                  same_plan=same_on_all_ranks([s.nodes for s in plan.segments]),
                  planned=_fsdp_tp_train(plan.module, x, mesh))
    finish_rank(out_dir, rank, result)


def test_fsdp_over_tensor_parallel_on_a_2_by_2_mesh(tmp_path):
    """FSDP2 over the data-parallel ranks of a tensor-parallel model (4 ranks, 2 x 2): one plan everywhere, the
    unplanned job's losses and gradients, each rank's peak (its FSDP shards of its TP shards) within the budget
    and within 1% of its prediction at the allocator, never over it but for a reduce-scatter gloo completes late
    (``in_flight_bytes``)."""
    from test_distributed import SMALL, close_to, in_flight_bytes

    results = run_ranks(fsdp_tp_worker, tmp_path, world_size=4, timeout_s=600)
    for r in results:
        assert r["segments"] and r["same_plan"] and r["segments"] == results[0]["segments"], r
        assert r["planned"]["losses"] == r["unplanned"]["losses"] and r["planned"]["grads"] == r["unplanned"]["grads"]
        late = SMALL + in_flight_bytes(Net())
        assert r["planned"]["peak"] <= r["budget"] + late, r
        assert close_to(r["predicted"], r["planned"]["peak"], slack=late, early=late), r  # loaded: gloo's
        # collectives run late both ways (measured under load: the prediction 264,664 B over, 3.0%)
    assert results[0]["unplanned"]["losses"] != results[2]["unplanned"]["losses"]  # dp ranks saw different data
