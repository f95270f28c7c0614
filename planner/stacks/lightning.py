"""``PlanCallback``: a Lightning ``Trainer`` (``pytorch_lightning``) plans the model at the start of training.

    trainer = pl.Trainer(..., callbacks=[PlanCallback("22GB")])

At ``on_train_start`` (optimizers made, the module on its device) the callback reads the step Lightning will run:
the optimizer (``trainer.optimizers``), ``precision`` (``"bf16-mixed"``/``"16-mixed"``: the step runs under
``torch.autocast``), ``accumulate_grad_batches``, and Lightning's own order: under automatic optimization it
zeroes gradients right before backward, so the last step's gradients are alive through the forward
(``zero_grad="before_backward"``). ``training_step`` returns the loss and drops the model's output before backward.
It plans ``module`` (by default the LightningModule's ``model`` attribute where it has one, else the
LightningModule itself) in place from the first batch of the training loader, mapped to the module's arguments by
``inputs`` (default: a dict batch as keyword arguments, a tuple as positional ones), with the module's own loss
(``outputs.loss``) unless ``loss_fn=`` says otherwise. A LightningModule passed to ``fit`` compiled
(``torch.compile(module)``, which Lightning unwraps and compiles again) gets a plan fitted to the step compiled with
the same backend (``compile_backend``), or, where the backend cannot be told, one that compiles (``compilable``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from pytorch_lightning import Callback

from planner.common.log import get_logger
from planner.compat.torch_private import compile_backend_of
from planner.errors import OptionError
from planner.inplace import enable
from planner.options import PlanOptions
from planner.stacks.batch import first_batch

LOG = get_logger("stacks")

AUTOCAST = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
"""Lightning's ``precision`` values that run the step under ``torch.autocast``, and its dtype."""


class PlanCallback(Callback):
    """Plans ``module`` of the LightningModule in place for ``budget`` when training starts.

    Args:
        budget: peak memory of one training step on one device, the optimizer's state and the gradients Lightning
            keeps alive included (``"22GB"``, ``"60%"``, bytes).
        module: the attribute of the LightningModule to plan (``"model"``); default ``model`` where it exists,
            else the LightningModule itself.
        inputs: ``batch -> tuple or dict`` of the module's arguments; default the batch itself.
        options, **overrides: ``PlanOptions`` fields (``loss_fn``, ``time_limit_s``...); what Lightning knows
            (optimizer, autocast, accumulation, zero_grad order, the dropped output) overrides them.

    Attributes:
        plan: the ``Plan`` once training has started, else None.
    """

    def __init__(self, budget: int | str, *, module: str | None = None,
                 inputs: Callable[[Any], tuple | Mapping] | None = None, options: PlanOptions | None = None,
                 **overrides: Any) -> None:
        self.budget, self.module, self.inputs = budget, module, inputs
        self.options, self.overrides = options, overrides
        self.plan: Any = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.plan is not None:
            return
        target = getattr(pl_module, self.module or "model", None) if self.module or hasattr(pl_module, "model") \
            else pl_module
        if not isinstance(target, torch.nn.Module):
            raise OptionError(f"PlanCallback(module={self.module!r}): the LightningModule has no nn.Module "
                              "attribute by that name; pass module= the attribute that holds the model")
        batch = pl_module.transfer_batch_to_device(first_batch(trainer.train_dataloader), pl_module.device, 0)
        self.plan = enable(target, self.budget, inputs=self.inputs(batch) if self.inputs else batch,
                           options=self.options, **{**self.overrides, **lightning_step(trainer, pl_module)})
        LOG.info("planned the model for the training loop:\n%s", self.plan.summary())


def lightning_step(trainer: Any, pl_module: Any) -> dict[str, Any]:
    """The options of the step this Lightning ``trainer`` runs (the module docstring says which)."""
    optimizers = list(getattr(trainer, "optimizers", []) or [])
    return {"optimizer": optimizers[0] if len(optimizers) == 1 else None, "keep_output": False,
            "autocast": AUTOCAST.get(str(trainer.precision)),
            "gradient_accumulation_steps": int(trainer.accumulate_grad_batches),
            "zero_grad": "before_backward" if pl_module.automatic_optimization else "before_forward",
            **_compiled(getattr(pl_module, "_compiler_ctx", None))}


def _compiled(context: Any) -> dict[str, Any]:
    """The options of a module Lightning compiles (``_compiler_ctx``, kept from ``torch.compile(module)``)."""
    if not context:
        return {}
    backend = compile_backend_of(context.get("dynamo_ctx")) if isinstance(context, Mapping) else None
    return {"compile_backend": backend} if backend is not None else {"compilable": True}
