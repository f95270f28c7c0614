"""``PlanCallback``: Hugging Face ``Trainer`` (and TRL's trainers, built on it) plans the model at the start of
training.

    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[PlanCallback("22GB")])

At ``on_train_begin`` (the optimizer made, the model placed and wrapped) the callback reads the step the Trainer
will run from its arguments and objects: the optimizer it created (its kind, hyperparameters and parameters),
``bf16``/``fp16`` (the step runs under ``torch.autocast`` in that dtype), ``gradient_accumulation_steps`` (whose
micro-batches Trainer takes from the loader together and holds through the optimizer step), the model's own loss
(``outputs.loss``), and an output Trainer drops before backward. It takes the first batch of the training loader
(the random generators put back: training sees the same batches) and plans the model object in place
(``planner.enable``), so the Trainer, its optimizer and its accelerate wrappers keep the object they hold.
``gradient_checkpointing=True`` (TRL's default) is left off with one warning: the plan replaces it. With
``torch_compile=True`` the plan is fitted to the step compiled with Trainer's ``torch_compile_backend``
(``compile_backend``: compiled and measured here), and the model Trainer compiles runs it.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import TrainerCallback

from planner.common.log import get_logger
from planner.compiled.backend import INDUCTOR
from planner.inplace import enable
from planner.options import PlanOptions
from planner.stacks.batch import first_batch, to_device

LOG = get_logger("stacks")


class PlanCallback(TrainerCallback):
    """Plans the Trainer's model in place for ``budget`` when training begins.

    Args:
        budget: peak memory of one training step on one device (``"22GB"``, ``"60%"``, bytes), optimizer state and
            the gradients accumulation keeps included.
        options: a ``PlanOptions``; the step's settings the Trainer knows (``optimizer``, ``autocast``,
            ``gradient_accumulation_steps``, ``keep_output``) are read from it and override these.
        **overrides: any other ``PlanOptions`` field (``time_limit_s``, ``must_save``...).

    Attributes:
        plan: the ``Plan`` once training has begun (``plan.summary()``), else None.
    """

    def __init__(self, budget: int | str, *, options: PlanOptions | None = None, **overrides: Any) -> None:
        self.budget = budget
        self.options = options
        self.overrides = overrides
        self.plan: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, *, model: Any = None, optimizer: Any = None,
                       train_dataloader: Any = None, **kwargs: Any) -> None:
        if self.plan is not None or model is None or train_dataloader is None:
            return  # planned already (train() called again on the same Trainer), or nothing to plan from
        batch = to_device(first_batch(train_dataloader), next(model.parameters()).device)
        self.plan = enable(model, self.budget, inputs=batch, options=self.options,
                           **{**self.overrides, **trainer_step(args, optimizer)})
        LOG.info("planned the model for the training loop:\n%s", self.plan.summary())


def trainer_step(args: Any, optimizer: Any) -> dict[str, Any]:
    """The options of the step a Trainer with these ``TrainingArguments`` runs: its optimizer, its autocast, its
    micro-steps (whose batches it takes from the loader together and holds through the optimizer step), no
    output kept through backward (``compute_loss`` returns the loss alone), and with ``torch_compile`` the
    backend it compiles with (``compile_backend``: the plan fitted to the compiled step)."""
    autocast = torch.bfloat16 if getattr(args, "bf16", False) else torch.float16 if getattr(args, "fp16", False) \
        else None
    steps = int(getattr(args, "gradient_accumulation_steps", 1) or 1)
    step = {"optimizer": _unwrapped(optimizer), "autocast": autocast, "keep_output": False,
            "gradient_accumulation_steps": steps, "batches_held": steps}
    if not getattr(args, "torch_compile", False):
        return step
    return {**step, "compile_backend": getattr(args, "torch_compile_backend", None) or INDUCTOR}


def _unwrapped(optimizer: Any) -> Any:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` (itself an ``Optimizer`` subclass that
    holds the real one); None stays None."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer
