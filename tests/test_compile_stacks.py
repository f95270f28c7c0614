"""The fine-tuning stacks compiling the model they train, each with ckplan's plan made in its own idiom: Trainer with
``torch_compile=True`` and ``PlanCallback``, an ``Accelerator`` with a dynamo backend and ``plan_with``, Lightning
fitting a compiled LightningModule with its ``PlanCallback``. Each stack tells the planner the backend it compiles
with, so the plan compiles (every segment one module call) and is fitted to the compiled step as measured
(``compile_backend``). The losses are the unplanned run's, compiled the same way, and the stack's own training
steps, measured at the allocator from the first step on, peak within the budget and within 2% of the plan's
``compiled_step`` (the optimizer's state included), where the unplanned compiled steps are over it.
``aot_eager`` compiles: AOTAutograd's graphs and partitioner, as inductor gets them, without its code generation
(minutes on 2 CPU cores; ``tests/test_compile_hooks.py`` and ``tests/test_compiled.py`` run inductor)."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

import transformers
from test_stacks import batch, model

from planner.profiling.allocator import AllocatorTrace

pytestmark = pytest.mark.slow

BACKEND = "aot_eager"
BUDGET = "75%"


class _Meter:
    """The allocator's peak from the first training step on (after planning, which runs when training begins):
    the parameters and buffers alive then, plus the highest rise since."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.trace: AllocatorTrace | None = None
        self.resident = 0

    def start(self) -> None:
        if self.trace is None:
            self.resident = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                                 for t in [*self.module.parameters(), *self.module.buffers()]}.values())
            self.trace = AllocatorTrace("cpu").__enter__()

    def stop(self) -> int:
        assert self.trace is not None, "no training step ran"
        self.trace.__exit__(None, None, None)
        return self.resident + self.trace.peak_bytes


def _check_peaks(planned: int, unplanned: int, plan) -> None:
    """The planned steps within the budget and within 2% of what the plan measured compiled; the unplanned over."""
    assert plan.compiled_step is not None, plan.summary()
    predicted = plan.compiled_step.peak_bytes
    assert planned <= plan.budget_bytes < unplanned, (planned, plan.budget_bytes, unplanned)
    assert abs(planned / predicted - 1) <= 0.02, (planned, predicted)


def _graphs() -> int:
    """Graphs dynamo has compiled since the last ``torch._dynamo.reset()``."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _one_call_segments(plan) -> bool:
    return bool(plan.segments) and all(len(s.chain) == 1 for s in plan.segments)


def _trainer_losses(module: torch.nn.Module, callbacks: list) -> tuple[list[float], int]:
    from datasets import Dataset

    meter = _Meter(module)

    class Measured(transformers.TrainerCallback):
        def on_step_begin(self, *args, **kwargs) -> None:
            meter.start()

    rows = batch(rows=12)
    data = Dataset.from_dict({"input_ids": rows["input_ids"].tolist(), "labels": rows["labels"].tolist()})
    args = transformers.TrainingArguments(output_dir="/tmp/ckplan-trainer-compiled", max_steps=3, report_to=[],
                                          per_device_train_batch_size=4, logging_steps=1, use_cpu=True,
                                          save_strategy="no", seed=0, disable_tqdm=True, torch_compile=True,
                                          torch_compile_backend=BACKEND)
    torch._dynamo.reset()
    trainer = transformers.Trainer(model=module, args=args, train_dataset=data, callbacks=[*callbacks, Measured()])
    trainer.train()
    assert _graphs() > 0  # the model Trainer trained was compiled
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry], meter.stop()


def test_trainer_with_torch_compile_trains_the_plan_compiled():
    from planner.stacks.trainer import PlanCallback

    base = model()
    unplanned, unplanned_peak = _trainer_losses(copy.deepcopy(base), [])
    planning = PlanCallback(BUDGET, time_limit_s=10)
    planned, planned_peak = _trainer_losses(base, [planning])
    assert _one_call_segments(planning.plan), planning.plan.summary()
    assert planned == pytest.approx(unplanned, rel=1e-4)
    _check_peaks(planned_peak, unplanned_peak, planning.plan)


def _accelerate_losses(module: torch.nn.Module, planned: bool) -> tuple[list[float], object, int]:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from planner.stacks.accelerate import plan_with

    AcceleratorState._reset_state(True)
    torch._dynamo.reset()
    accelerator = Accelerator(cpu=True, dynamo_backend=BACKEND)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    plan = plan_with(accelerator, module, BUDGET, inputs=batch(), optimizer=optimizer, keep_output=False,
                     time_limit_s=10) if planned else None
    trained, optimizer = accelerator.prepare(module if plan is None else plan.module, optimizer)
    losses = []
    meter = _Meter(module)
    meter.start()
    for step in range(3):
        loss = trained(**batch(length=64 - step)).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    peak = meter.stop()
    assert _graphs() > 0
    AcceleratorState._reset_state(True)
    return losses, plan, peak


def test_an_accelerator_with_a_dynamo_backend_trains_the_plan_compiled():
    base = model()
    unplanned, _, unplanned_peak = _accelerate_losses(copy.deepcopy(base), planned=False)
    planned, plan, planned_peak = _accelerate_losses(base, planned=True)
    assert _one_call_segments(plan), plan.summary()
    assert planned == pytest.approx(unplanned, rel=1e-4)
    _check_peaks(planned_peak, unplanned_peak, plan)


def _lightning_losses(planned: bool) -> tuple[list[float], object, int]:
    pl = pytest.importorskip("pytorch_lightning")
    from planner.stacks.lightning import PlanCallback

    class Finetune(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model()
            self.losses: list[float] = []

        def training_step(self, step_batch: dict, batch_idx: int) -> torch.Tensor:
            loss = self.model(**step_batch).loss
            self.losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    ids = batch(rows=12)["input_ids"]
    loader = torch.utils.data.DataLoader([{"input_ids": row, "labels": row} for row in ids], batch_size=4)
    planning = PlanCallback(BUDGET, time_limit_s=10)
    module = Finetune()
    meter = _Meter(module)

    class Measured(pl.Callback):
        def on_train_batch_start(self, *args, **kwargs) -> None:
            meter.start()

    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[*([planning] if planned else []), Measured()])
    torch._dynamo.reset()
    trainer.fit(torch.compile(module, backend=BACKEND), loader)
    assert _graphs() > 0
    return module.losses, planning.plan, meter.stop()


def test_lightning_fitting_a_compiled_module_trains_the_plan_compiled():
    unplanned, _, unplanned_peak = _lightning_losses(planned=False)
    planned, plan, planned_peak = _lightning_losses(planned=True)
    assert _one_call_segments(plan), plan.summary()
    assert planned == pytest.approx(unplanned, rel=1e-4)
    _check_peaks(planned_peak, unplanned_peak, plan)
