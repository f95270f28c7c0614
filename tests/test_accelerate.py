"""A planned model trained through Hugging Face accelerate: ``Accelerator.prepare`` on one CPU process (a plan's
module and a model planned in place), and a 2-rank DDP job on gloo launched with the environment accelerate reads.
The losses (and, on the ranks, the gradients) are the unplanned run's; each planned step's measured peak is within
its budget."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from accelerate import Accelerator
from accelerate.state import AcceleratorState
from test_distributed import close_to, run_ranks
from test_distributed_hf import BUDGET, make_model, rank_batch
from test_stacks import batch, model

from planner import enable, optimize
from planner.profiling.memtrack import LiveStorages

pytestmark = pytest.mark.slow


@pytest.fixture
def fresh_accelerate_state():
    """accelerate keeps its state in process-wide singletons: each test starts and leaves them empty."""
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def rows(count: int, length: int, seed: int = 1) -> list[dict]:
    """A map-style dataset of ``count`` language-modelling rows; the default collate stacks them into batches."""
    ids = torch.randint(0, 120, (count, length), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": row, "labels": row} for row in ids]


def train(accelerator: Accelerator, module: torch.nn.Module, data: list[dict]) -> tuple[list[float], list[int]]:
    """Three AdamW steps of ``module`` prepared by ``accelerator``: each step's loss and its measured peak (the exact
    storage tracker around forward and ``accelerator.backward``, with parameters, buffers and the batch resident, as
    ``measure_peak`` counts a step)."""
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    prepared, optimizer, loader = accelerator.prepare(module, optimizer, loader)
    losses, peaks = [], []
    for step_batch in loader:
        tracker = LiveStorages("cpu")
        for t in [*prepared.parameters(), *prepared.buffers(), *step_batch.values()]:
            tracker.track(t)
        with tracker:
            loss = prepared(**step_batch).loss  # the output is dropped before backward: keep_output=False
            accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        peaks.append(tracker.peak_bytes)
    return losses, peaks


@pytest.mark.parametrize("how", ["optimize", "enable"])
def test_a_planned_model_trains_through_accelerator_prepare(how, fresh_accelerate_state):
    """``optimize(...).module`` or a model planned in place by ``enable``, then ``accelerator.prepare(model,
    optimizer, dataloader)``: the losses are the unplanned model's, every step's peak within the budget and within 1%
    of the prediction (2 KiB over it: the collated labels are a storage of their own, where the example's share
    input_ids')."""
    accelerator = Accelerator(cpu=True)
    data = rows(12, 64)
    expected, _ = train(accelerator, model(), data)
    base = model()
    if how == "optimize":
        plan = optimize(base, "60%", inputs=batch(), keep_output=False, time_limit_s=10)
        module = plan.module
    else:
        plan = enable(base, "60%", inputs=batch(), keep_output=False, time_limit_s=10)
        module = base
    assert plan.segments
    losses, peaks = train(accelerator, module, data)
    assert losses == expected
    for peak in peaks:
        assert abs(peak - plan.predicted_peak_bytes) <= 0.01 * peak and peak <= plan.budget_bytes, (peak, plan)


def ddp_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """One rank of a CPU DDP job as ``accelerate launch`` starts it: the environment it sets, then
    ``Accelerator(cpu=True)``, which joins the gloo process group. The unplanned job, then the plan made on rank 0
    (``plan_on_rank0``, DDP, AdamW), each prepared and trained by accelerate."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    from accelerate.utils import DistributedType

    from planner.distributed.rank import plan_on_rank0, rank_peak_bytes, resident_bytes, same_on_all_ranks

    accelerator = Accelerator(cpu=True)
    assert accelerator.distributed_type == DistributedType.MULTI_CPU and accelerator.num_processes == world_size
    data = [rank_batch(seed) for seed in range(3 * world_size)]  # 4 x 128 tokens a batch; accelerate shards them
    data = [{name: value[row] for name, value in b.items()} for b in data for row in range(len(b["input_ids"]))]

    def run(module: torch.nn.Module) -> dict:
        """3 steps: the losses, the gradient norms of step 0 (all-reduced by DDP), the allocator's peak of step 2 with
        DDP's gradient buckets and AdamW's state resident (not step 1: DDP rebuilds its buckets in the second
        forward, in the order the first backward made the gradients, and holds both sets a moment)."""
        buckets = sum(p.numel() * p.element_size() for p in module.parameters())
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
        loader = torch.utils.data.DataLoader(data, batch_size=4)
        wrapped, optimizer, loader = accelerator.prepare(module, optimizer, loader)
        assert isinstance(wrapped, torch.nn.parallel.DistributedDataParallel)
        losses, grads, peak = [], [], 0
        for step, step_batch in enumerate(loader):
            out: list[torch.Tensor] = []

            def one_step(out: list = out, step_batch: dict = step_batch) -> None:
                out.append(wrapped(**step_batch).loss)
                accelerator.backward(out[-1])

            if step == 2:
                peak = rank_peak_bytes(one_step, resident_bytes(module, optimizer.optimizer, step_batch) + buckets)
            else:
                one_step()
            if step == 0:
                grads = [float(p.grad.double().norm()) for p in module.parameters()]
            optimizer.step()
            optimizer.zero_grad()
            losses.append(out[-1].item())
        return {"losses": losses, "grads": grads, "peak": peak}

    example = rank_batch(0)  # the first batch of the dataset
    result = {"unplanned": run(make_model("qwen2"))}
    plan = plan_on_rank0(make_model("qwen2"), BUDGET, inputs=example, parallel="ddp", optimizer="adamw",
                         time_limit_s=20, keep_output=False)
    result.update(segments=[list(s.chain) for s in plan.segments], budget=plan.budget_bytes,
                  predicted=plan.predicted_peak_bytes, baseline=plan.baseline_peak_bytes,
                  same_plan=same_on_all_ranks([s.chain for s in plan.segments]), planned=run(plan.module))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    accelerator.free_memory()  # the DDP wrappers go before their process group (one outliving gloo's can hang)
    accelerator.end_training()
    os._exit(0)  # past C++'s exit-time teardown, as test_distributed.finish_rank does


def test_a_plan_made_on_rank0_trains_in_accelerates_ddp_job(tmp_path):
    """2 gloo ranks: the planned job's losses and all-reduced gradients equal the unplanned job's, and each rank's
    peak, measured at the allocator, is within the budget and within 1% of the prediction, never over it."""
    results = run_ranks(ddp_worker, tmp_path, timeout_s=240)
    for r in results:
        assert r["same_plan"] and r["segments"], r
        assert r["planned"]["losses"] == r["unplanned"]["losses"] and r["planned"]["grads"] == r["unplanned"]["grads"]
        assert r["planned"]["peak"] <= r["budget"], r
        assert close_to(r["predicted"], r["planned"]["peak"]) and close_to(r["baseline"], r["unplanned"]["peak"]), r
    assert results[0]["unplanned"]["losses"] != results[1]["unplanned"]["losses"]  # accelerate sharded the data
