"""Pipeline parallelism: each stage planned for the microbatches its schedule keeps in flight. The counts of
``planner.memory.pipeline`` against torch.distributed.pipelining's own schedule tables."""

from __future__ import annotations

import pytest

from planner.memory.pipeline import Pipeline, Schedule


def _stub_stage(index: int, stages: int, rank: int, ranks: int):
    """A stage object that schedules accept for building their tables (no process group, no module)."""
    from torch.distributed.pipelining.stage import _PipelineStageBase

    class Stub(_PipelineStageBase):
        _create_grad_recv_info = _prepare_backward_infra = _prepare_forward_infra = lambda *a, **k: None

        def __init__(self) -> None:  # no super().__init__: it needs a process group
            self.stage_index, self.num_stages, self.group_rank, self.group_size = index, stages, rank, ranks
            self.submod, self.device, self.group, self.dw_builder = None, "cpu", None, None

    return Stub()


def _most_in_flight(order) -> int:
    """The most microbatches between their forward and their backward in a rank's action list."""
    alive = most = 0
    for action in order:
        if action is None:
            continue
        kind = action.computation_type.name
        alive += 1 if kind == "FORWARD" else -1 if kind in ("FULL_BACKWARD", "BACKWARD_INPUT") else 0
        most = max(most, alive)
    return most


@pytest.mark.parametrize("schedule", [Schedule.GPIPE, Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED_1F1B])
def test_the_microbatches_in_flight_are_those_of_torchs_schedules(schedule):
    from torch.distributed.pipelining import schedules

    kind = {Schedule.GPIPE: schedules.ScheduleGPipe, Schedule.ONE_F_ONE_B: schedules.Schedule1F1B,
            Schedule.INTERLEAVED_1F1B: schedules.ScheduleInterleaved1F1B}[schedule]
    for stages in (2, 3, 4, 8):
        for microbatches in sorted({stages, 2 * stages, 3 * stages}):
            for chunks in ((1,) if schedule is not Schedule.INTERLEAVED_1F1B else (1, 2, 4)):
                pipeline = Pipeline(schedule=schedule, stages=stages, microbatches=microbatches, chunks=chunks)
                for rank in range(stages):
                    if schedule is Schedule.INTERLEAVED_1F1B:
                        local = [_stub_stage(rank + j * stages, stages * chunks, rank, stages) for j in range(chunks)]
                        order = kind(local, microbatches).pipeline_order[rank]
                    else:
                        order = kind(_stub_stage(rank, stages, rank, stages), microbatches)._get_pipeline_order()[rank]
                    assert pipeline.in_flight(rank) == _most_in_flight(order), (stages, microbatches, chunks, rank)


# ---- 2 stages on gloo, torch.distributed.pipelining ---------------------------------------------------------------

VOCAB, WIDTH, LAYERS, MICROBATCHES, ROWS, LENGTH = 256, 64, 4, 4, 8, 64


def _on_path() -> None:
    """The bundled examples importable (``gpt``, ``llama_pipeline``)."""
    import sys
    from pathlib import Path

    if str(Path(__file__).parents[1] / "examples") not in sys.path:
        sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))


def _gpt():
    _on_path()
    import torch
    from gpt import GPT, Config

    torch.manual_seed(0)
    model = GPT(Config(vocab=VOCAB, context=LENGTH, width=WIDTH, heads=4, layers=LAYERS, dropout=0.0))
    model.head.weight = torch.nn.Parameter(model.wte.weight.detach().clone())  # untied: the two are on two stages
    return model


def _stages(model, n: int = 2):
    """The GPT split by blocks into ``n`` stages, as torchtitan splits a decoder: the embeddings on the first, the
    final norm and the head on the last."""
    import torch
    from torch import nn

    per = LAYERS // n

    class Stage(nn.Module):
        def __init__(self, index: int) -> None:
            super().__init__()
            self.first, self.last = index == 0, index == n - 1
            self.blocks = model.blocks[index * per:(index + 1) * per]
            if self.first:
                self.wte, self.wpe = model.wte, model.wpe
            if self.last:
                self.ln_f, self.head = model.ln_f, model.head

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.first:
                x = self.wte(x) + self.wpe(torch.arange(x.size(1), device=x.device))
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln_f(x)) if self.last else x

    return tuple(Stage(i) for i in range(n))


def _data(vocab: int = VOCAB):
    import torch

    tokens = torch.randint(0, vocab, (ROWS, LENGTH + 1), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _ce(logits, target):
    import torch.nn.functional as F

    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _split(name: str, n: int = 2):
    """The whole model, its ``n`` stage modules (sharing its parameters), its vocabulary and width: the GPT example,
    or a Hugging Face Llama split by its decoder layers (``examples/llama_pipeline.py``)."""
    if name == "gpt":
        model = _gpt()
        return model, _stages(model, n), VOCAB, WIDTH
    _on_path()
    import llama_pipeline

    model = llama_pipeline.small_llama()
    return model, llama_pipeline.split(model, n), model.config.vocab_size, model.config.hidden_size


def _example(name: str, stage: int, n: int = 2):
    """One microbatch of stage ``stage``'s input (of ``n``), and the loss it is planned with: the first stage's token
    ids, or hidden states as received (their gradient is sent back); the cross entropy on the last, the sum of the
    outputs on the others (no output gradient buffer)."""
    import torch

    _, _, vocab, width = _split(name, n)
    x, y = _data(vocab)
    rows = ROWS // MICROBATCHES
    given = (x[:rows],) if stage == 0 else (torch.randn(rows, LENGTH, width, requires_grad=True),)
    return given, (lambda logits: _ce(logits, y[:rows])) if stage == n - 1 else None


def _train(pipe, stage, module, first: bool, x, y, gathered=lambda grad: grad, return_outputs: bool = True) -> dict:
    """4 steps of ``pipe``: the losses (on the last stage), the gradients of step 1 (``gathered`` from shards) and the
    median peak of steps 2-4 at the allocator, counting what is alive as a step starts: the module's parameters, the
    batch (the inputs on the first stage, the targets on the last: each a stage uses; the others hold neither in
    a pipelined loop), the stage's receive buffers and the last step's outputs (counted, not held). The median:
    under load one step can read higher, gloo sending late. ``return_outputs=False``: the last stage keeps no
    outputs, as torchtitan runs it."""
    import torch

    from planner.compat.torch_private import tree_leaves
    from planner.distributed import resident_bytes
    from planner.profiling.allocator import AllocatorTrace

    losses: list = []
    peaks, grads = [], []
    for step in range(4):
        for p in module.parameters():
            p.grad = None
        buffers = [info.buffer for infos in [*stage.args_recv_info.values(), *stage.grad_recv_info.values()]
                   for info in infos if getattr(info, "buffer", None) is not None]
        left = [t for t in tree_leaves(stage.output_chunks) if isinstance(t, torch.Tensor)]
        resident = resident_bytes(module, [x] if first else [], [] if pipe._stage.is_last is False else [y],
                                  buffers, left)
        del left
        with AllocatorTrace("cpu") as trace:
            if first:
                pipe.step(x)
            else:
                losses = []
                pipe.step(target=y, losses=losses, return_outputs=return_outputs)
        peaks.append(resident + trace.peak_bytes)
        if step == 0:
            grads = [gathered(p.grad).tolist() for p in module.parameters()]
    return {"peak": sorted(peaks[1:])[1], "losses": [float(v) for v in losses], "grads": grads}


def _stage_worker(rank: int, world_size: int, port: int, out_dir: str, name: str, schedule: str,
                  budget: str | tuple[str, ...], offload: bool = False) -> None:
    """One stage of 2 on its own rank, planned at ``budget`` (or this rank's of them) for its place in the pipeline,
    run by ``schedule``. ``offload``: the plan may offload kept activations of 4 KiB and more, to this CPU's host
    store, which ``offload=`` refuses (the same memory; ``planner.rewrite.offload`` copies to a store the allocator
    trace leaves out, as a GPU's pinned host memory is)."""
    import torch
    from test_distributed import _init, finish_rank
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    import planner.pipeline
    from planner import optimize
    from planner.planning.offloading import host_link
    from planner.rewrite.offload import offloader_of
    from planner.solve.offload import OffloadLimits

    _init(rank, world_size, port)
    if offload:
        planner.pipeline.offload_limits = lambda prepared, options: OffloadLimits(
            link=host_link(prepared.profile), min_bytes=4096)
    budget = budget if isinstance(budget, str) else budget[rank]
    _, stages, vocab, _ = _split(name, world_size)
    example, loss_fn = _example(name, rank, world_size)
    outputs = name == "gpt"  # the Llama's last stage returns no outputs (keep_output=False), as torchtitan runs it
    plan = optimize(stages[rank], budget, inputs=example, loss_fn=loss_fn,
                    pipeline=f"{schedule}:{world_size}:{MICROBATCHES}", pipeline_rank=rank, follow_batch=False,
                    time_limit_s=20, keep_output=outputs or rank < world_size - 1)
    stage = PipelineStage(plan.module, stage_index=rank, num_stages=world_size, device=torch.device("cpu"))
    kind = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule]
    run = _train(kind(stage, n_microbatches=MICROBATCHES, loss_fn=_ce), stage, stages[rank], rank == 0,
                 *_data(vocab), return_outputs=outputs)
    offloader = offloader_of(plan.module)
    offloads = {} if offloader is None else {"missed": offloader.missed, "host_peak": offloader.host_peak_bytes,
                                             "host_predicted": plan.pipeline_stage.host_bytes}
    finish_rank(out_dir, rank, {**run, "predicted": plan.pipeline_stage.peak_bytes, "budget": plan.budget_bytes,
                                "segments": len(plan.segments), "stage": rank, **offloads})


def _reference(name: str, n: int = 2) -> tuple[float, list[list]]:
    """The un-pipelined model's loss and gradients on the whole batch, per stage's parameters (``n`` stages)."""
    model, stages, vocab, _ = _split(name, n)
    x, y = _data(vocab)
    logits = model(x) if name == "gpt" else model(input_ids=x).logits
    loss = _ce(logits, y)
    loss.backward()
    return loss.item(), [[p.grad.tolist() for p in stage.parameters()] for stage in stages]


def _check(results: list[dict], name: str, late: int = 0, n: int = 2, over: float = 0.02) -> None:
    """Losses and gradients the whole model's; every rank within its budget and 2% of its prediction (predicted at
    most ``over`` above), give or take ``late`` bytes (what an FSDP2 collective gloo completes late holds:
    ``test_distributed.in_flight_bytes``)."""
    import torch

    loss, grads = _reference(name, n)
    assert all(r["segments"] or r.get("host_predicted") for r in results)  # each plan checkpoints or offloads
    for result in results:
        if result["stage"] == n - 1:
            assert sum(result["losses"]) / MICROBATCHES == pytest.approx(loss, rel=1e-5)
        for got, expected in zip(result["grads"], grads[result["stage"]]):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-4, atol=1e-6)
    for result in results:
        peak, predicted = result["peak"], result["predicted"]
        assert peak <= result["budget"] + late, result
        assert -0.02 * peak - late <= predicted - peak <= over * peak + late, (result["stage"], peak, predicted)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "schedule"), [("gpt", "1f1b"), ("gpt", "gpipe"), ("llama", "1f1b")])
def test_two_stages_on_gloo_fit_their_budget_as_predicted_and_train_as_the_whole_model(tmp_path, name, schedule):
    """Measured (GPT): predicted +0.0% (1F1B) and -0.0% (GPipe) of the first stage's peak (within 32 bytes), +0.3%
    and +1.0% of the last's; the Llama, its last stage keeping no outputs: +0.0% and -0.1%."""
    import functools

    from test_distributed import run_ranks

    _check(run_ranks(functools.partial(_stage_worker, name=name, schedule=schedule, budget="85%"), tmp_path,
                     timeout_s=300), name)


@pytest.mark.slow
def test_a_stage_that_offloads_fits_its_budget_as_predicted_and_trains_as_the_whole_model(tmp_path):
    """2 GPT stages under 1F1B whose plans may offload. The first, at a budget below the least its checkpointing
    plans reach (45% of its peak without checkpointing, against 46%), checkpoints and offloads: each of its 2
    microbatches in flight holds what its forward kept less what it offloaded, and the host store a copy of each
    one's offloads. The last (85%) offloads where it would re-run (this CPU's copies cost less than the re-runs).
    Measured: predicted +0.0% (16 bytes) and +0.3% of the peaks; the host store's peak exactly as predicted."""
    import functools

    from test_distributed import run_ranks

    results = run_ranks(functools.partial(_stage_worker, name="gpt", schedule="1f1b", budget=("45%", "85%"),
                                          offload=True), tmp_path, timeout_s=300)
    _check(results, "gpt")
    first = next(r for r in results if r["stage"] == 0)
    assert first["segments"] and first["host_predicted"]
    for result in results:
        assert result.get("missed", 0) == 0 and result.get("host_peak", 0) == result.get("host_predicted", 0)


@pytest.mark.slow
def test_four_stages_on_gloo_fit_their_budget_as_predicted_and_train_as_the_whole_model(tmp_path):
    """The GPT's 4 blocks on 4 ranks under 1F1B (4, 3, 2 and 1 microbatches in flight); on every stage but the
    last, the output whose send the schedule still holds past its backward (``Pipeline.sends_held``: without it,
    the third read 2.2% under).
    Measured, predicted against measured: +0.0%, +0.0%, +0.0% and +0.4% (the first three within 264 bytes): a
    stage before the last receives its output's gradient dense
    (``received_gradient``: the stand-in loss's broadcast, made dense inside the last matmul's backward in the
    profile, would count a hidden-sized tensor more)."""
    import functools

    from test_distributed import run_ranks

    _check(run_ranks(functools.partial(_stage_worker, name="gpt", schedule="1f1b", budget="85%"), tmp_path,
                     world_size=4, timeout_s=400), "gpt", n=4)


def _fsdp_stage_worker(rank: int, world_size: int, port: int, out_dir: str, budget: str) -> None:
    """One rank of 2 pipeline stages x 2 FSDP2 ranks (a ("pp", "dp") mesh, both data ranks given the same batch):
    each stage planned on its first data rank for its FSDP ranks (``plan_on_rank0`` over the data group), sharded
    by blocks with ``reshard_after_forward=False`` as torchtitan shards under pipeline parallelism, run by
    ``Schedule1F1B``."""
    import torch
    from test_distributed import _init, finish_rank
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from planner.distributed import fully_shard_units, plan_on_rank0

    _init(rank, world_size, port)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp = mesh["pp"].get_local_rank()
    example, loss_fn = _example("gpt", pp)
    plan = plan_on_rank0(_stages(_gpt())[pp], budget, src=2 * pp, group=mesh["dp"].get_group(), inputs=example,
                         loss_fn=loss_fn, pipeline=f"1f1b:2:{MICROBATCHES}", pipeline_rank=pp, follow_batch=False,
                         time_limit_s=20)
    module = fully_shard_units(plan.module, mesh=mesh["dp"], reshard_after_forward=False)
    stage = PipelineStage(module, stage_index=pp, num_stages=2, device=torch.device("cpu"),
                          group=mesh["pp"].get_group())
    run = _train(Schedule1F1B(stage, n_microbatches=MICROBATCHES, loss_fn=_ce), stage, module, pp == 0, *_data(),
                 gathered=lambda grad: grad.full_tensor())
    finish_rank(out_dir, rank, {**run, "predicted": plan.pipeline_stage.peak_bytes, "budget": plan.budget_bytes,
                                "segments": len(plan.segments), "stage": pp})


@pytest.mark.slow
def test_fsdp_ranks_inside_two_stages_fit_their_budget_as_predicted_and_train_as_the_whole_model(tmp_path):
    """Each stage's parameters stay gathered and its gradients un-sharded through the microbatches (FSDP2 under
    torch.distributed.pipelining): each of the 4 ranks within its budget and 2% of the prediction (measured +0.0%
    on the first stage's ranks, +0.3% on the last's), the gradients the whole model's. Give or take one block's
    gradients: one step in four or so read a block's parameter bytes higher on the first stage's ranks, as gloo
    completes a collective late (as ``test_distributed``'s FSDP2 runs allow)."""
    import functools

    from test_distributed import in_flight_bytes, run_ranks

    _check(run_ranks(functools.partial(_fsdp_stage_worker, budget="85%"), tmp_path, world_size=4, timeout_s=400),
           "gpt", late=in_flight_bytes(_gpt(), ["blocks.*"]))


def test_a_stage_early_in_the_pipeline_re_runs_more_than_the_last_at_one_budget():
    """Under 1F1B on 4 stages, the second stage holds 3 microbatches at once and the last one: the same stage
    planned at the same per-rank budget re-runs as the second where the last fits without, and each plan's stage
    peak fits the budget."""
    import torch

    from planner import optimize

    first = _stages(_gpt())[0]
    x, _ = _data()
    example = (x,)  # microbatches of 8 rows: activations outweigh this small stage's parameters
    plans = [optimize(first, 12_000_000, inputs=example, pipeline=f"1f1b:4:{MICROBATCHES}", pipeline_rank=rank,
                      follow_batch=False, time_limit_s=20) for rank in (1, 3)]
    assert [p.pipeline_stage.in_flight for p in plans] == [3, 1]
    assert all(p.pipeline_stage.peak_bytes <= p.budget_bytes for p in plans)
    assert plans[0].recompute_ms > plans[1].recompute_ms
    assert "pipeline stage 1: 3 microbatches in flight" in plans[0].summary()
    assert torch.is_tensor(example[0])


@pytest.mark.parametrize(("options", "message"), [
    ({"pipeline": "zigzag:4:8"}, "'zigzag' is not a valid Schedule"),
    ({"pipeline": "1f1b:4"}, "two or three numbers"),
    ({"pipeline": "1f1b:4:8:2"}, "2 chunks per rank need the interleaved schedule"),
    ({"pipeline": "1f1b:4:8", "pipeline_rank": 4}, "pipeline_rank must be a stage of the pipeline, 0 to 3"),
    ({"pipeline_rank": 1}, "give pipeline= too"),
])
def test_a_malformed_pipeline_is_one_line(options, message):
    from planner import OptionError
    from planner.options import resolve

    with pytest.raises(OptionError, match=message):
        resolve(None, options, where="optimize")


@pytest.mark.slow
def test_plan_stages_plans_every_stage_of_a_split_model_from_the_first_stages_microbatch():
    """The second stage's example is what the first makes of the microbatch (requiring gradients, as received); the
    last is planned with the loss, the others with the sum of their outputs."""
    from planner import OptionError
    from planner.distributed import plan_stages

    stages = _stages(_gpt())
    x, y = _data()
    rows = ROWS // MICROBATCHES
    plans = plan_stages(stages, "85%", inputs=(x[:rows],), pipeline=f"1f1b:2:{MICROBATCHES}",
                        loss_fn=lambda logits: _ce(logits, y[:rows]), follow_batch=False, time_limit_s=20)
    assert [p.pipeline_stage.in_flight for p in plans] == [2, 1]
    assert [p.pipeline_stage.rank for p in plans] == [0, 1]
    assert all(p.pipeline_stage.peak_bytes <= p.budget_bytes for p in plans)
    assert list(plans[1].planned_inputs.values()) == [(rows, LENGTH, WIDTH)]
    with pytest.raises(OptionError, match="one stage module per pipeline rank: 2 given for 4 stages"):
        plan_stages(stages, "85%", inputs=(x[:rows],), pipeline="1f1b:4:8")
    with pytest.raises(OptionError, match="give pipeline="):
        plan_stages(stages, "85%", inputs=(x[:rows],))


def test_a_stage_planned_from_a_profile_that_dropped_its_output_is_refused_in_one_line():
    """The schedule holds each microbatch's output until its backward: a model prepared with keep_output=False and
    no pipeline has not counted it."""
    import torch

    from planner import OptionError, plan_for, prepare

    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 32))
    prepared = prepare(model, inputs=(torch.randn(8, 32),), keep_output=False, follow_batch=False)
    with pytest.raises(OptionError, match="prepare the stage with pipeline= too"):
        plan_for(prepared, "90%", pipeline="1f1b:2:4")


@pytest.mark.slow
def test_a_stage_re_runs_no_more_than_the_best_placement_of_whole_blocks_that_fits():
    """Exact reference: every subset of the GPT's 4 blocks checkpointed, each subset's stage peak simulated as the
    runtime holds it (4 microbatches in flight). At the tightest budget (every block) ckplan's plan fits and re-runs
    no more than it; at looser ones, within 5% of the cheapest subset that fits (the step's target is searched, not
    solved for: measured from 1.3% over to 19% under it)."""
    import itertools

    from planner import plan_for, prepare
    from planner.planning.pipelined import held_by_stage, unplanned_stage_peak
    from planner.planning.prepared import chunked
    from planner.solve.baselines import _fixed

    x, y = _data()
    rows = ROWS // MICROBATCHES
    pipeline = Pipeline(schedule=Schedule.ONE_F_ONE_B, stages=4, microbatches=8)
    prepared = prepare(_gpt(), inputs=(x[:rows],), loss_fn=lambda logits: _ce(logits, y[:rows]), pipeline=pipeline,
                       follow_batch=False)
    unplanned = unplanned_stage_peak(prepared, pipeline, 0)
    wide = chunked(prepared, 4 * LAYERS)
    blocks = list(wide.regions.blocks)
    assert len(blocks) == LAYERS
    placements = [_fixed(wide.memory, tuple(chosen)) for n in range(1, LAYERS + 1)
                  for chosen in itertools.combinations(blocks, n)]
    peaks = [(held_by_stage(prepared, (wide, p), pipeline, 0, unplanned).peak_bytes, p.recompute_us)
             for p in placements]
    for i, budget in enumerate(sorted({peak for peak, _ in peaks})[::3]):  # the tightest (every block), 2 looser
        cheapest = min(cost for peak, cost in peaks if peak <= budget)
        plan = plan_for(prepared, budget, pipeline_rank=0, time_limit_s=20)
        assert plan.pipeline_stage.peak_bytes <= budget
        assert plan.recompute_ms * 1000 <= cheapest * (1 if i == 0 else 1.05) + 1, (budget, plan.recompute_ms,
                                                                                    cheapest / 1000)


def test_offloads_chosen_for_a_stage_bring_its_peak_as_held_under_the_budget():
    """``StageRuler`` reads a plan's stage peak as ``held_by_stage`` does, offloads included: each other microbatch
    in flight holds what its forward kept less what it offloaded. Offloads chosen to bring a stage 10% down from
    its plan's peak do (a fast link), and the host store holds a copy for each microbatch in flight."""
    from dataclasses import replace

    from planner import prepare
    from planner.memory.offload import NO_OFFLOADS, HostLink, offloaded_bytes
    from planner.planning.pipelined import StageRuler, held_by_stage, unplanned_stage_peak
    from planner.planning.prepared import chunked
    from planner.solve.baselines import every_block
    from planner.solve.offload import OffloadLimits, choose_offloads

    x, _ = _data()
    pipeline = Pipeline(schedule=Schedule.ONE_F_ONE_B, stages=4, microbatches=8)
    prepared = prepare(_gpt(), inputs=(x[:ROWS // MICROBATCHES],), pipeline=pipeline, follow_batch=False)
    unplanned = unplanned_stage_peak(prepared, pipeline, 0)
    wide = chunked(prepared, 4 * LAYERS)  # a cut at every block edge
    solution = every_block(wide.memory, 0)
    pair = (wide, solution)
    ruler = StageRuler(prepared, pair, pipeline, 0)
    held = held_by_stage(prepared, pair, pipeline, 0, unplanned)
    assert ruler.peak(NO_OFFLOADS)[2] == held.peak_bytes and held.host_bytes == 0
    budget = int(held.peak_bytes * 0.9)
    limits = OffloadLimits(link=HostLink.from_gb_per_s(1000, 1000, overlaps=True), min_bytes=1)
    offloads = choose_offloads(wide.memory, solution.plan, solution.saves, budget, limits, ruler)
    assert offloads is not None and offloads.n
    offloaded = held_by_stage(prepared, (wide, replace(solution, offloads=offloads)), pipeline, 0, unplanned)
    assert offloaded.peak_bytes == ruler.peak(offloads)[2] <= budget
    assert offloaded.per_microbatch_bytes == held.per_microbatch_bytes - offloaded_bytes(wide.memory, offloads)
    assert offloaded.host_bytes == pipeline.in_flight(0) * offloaded_bytes(wide.memory, offloads)


def test_a_stage_before_the_last_receives_its_outputs_gradient_dense_not_as_the_stand_in_loss_sends_it():
    """The stand-in loss (the sum of the outputs) sends each output a stride-0 broadcast, which the last Linear's
    backward makes dense inside its matmul (the allocator sees it, the dispatcher does not); the profile records its
    size at the nodes that receive it, and a stage before the last, whose gradient arrives dense in a buffer the
    runtime holds, takes it out of their backward. The last stage's loss is the loop's own: as profiled."""
    import torch

    from planner import prepare
    from planner.planning.pipelined import received_gradient

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    x = torch.randn(32, 16, 64)
    prepared = prepare(model, inputs=(x,), pipeline="1f1b:2:4", follow_batch=False)
    dense = 32 * 16 * 64 * 4
    expanded = {node.name: node.bwd_expanded_grad_bytes for node in prepared.profile.nodes
                if node.bwd_expanded_grad_bytes}
    assert expanded and set(expanded.values()) == {dense}, expanded
    pipeline = Pipeline(schedule=Schedule.ONE_F_ONE_B, stages=2, microbatches=4)
    first = {n.name: n.bwd_hidden_bytes for n in received_gradient(prepared, pipeline, 0).profile.nodes}
    profiled = {n.name: n.bwd_hidden_bytes for n in prepared.profile.nodes}
    taken = {name: profiled[name] - first[name] for name in profiled if profiled[name] != first[name]}
    assert taken and all(0 < bytes_ <= dense for bytes_ in taken.values()) and set(taken) <= set(expanded), taken
    assert received_gradient(prepared, pipeline, 1) is prepared
    with_loss = prepare(model, inputs=(x,), loss_fn=lambda out: (out ** 2).mean(), pipeline="1f1b:2:4",
                        follow_batch=False)
    assert not any(node.bwd_expanded_grad_bytes for node in with_loss.profile.nodes)  # a dense gradient
