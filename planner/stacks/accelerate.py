"""``plan_with``: an accelerate training loop plans its model with what its ``Accelerator`` knows.

    accelerator = Accelerator(gradient_accumulation_steps=4, mixed_precision="bf16")
    optimizer = torch.optim.AdamW(model.parameters())
    model = plan_with(accelerator, model, "22GB", inputs=next(iter(loader)), optimizer=optimizer).module
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

The helper reads the ``Accelerator``'s ``gradient_accumulation_steps``, ``mixed_precision`` (``bf16``/``fp16``:
the step runs under ``torch.autocast``) and dynamo backend (``prepare`` compiles the model: on one process the plan
is fitted to the step compiled with that backend, ``compile_backend``; on several, made to compile,
``compilable``, for the eager step) and plans the model before ``prepare`` wraps it: on one process in place
(``enable``: ``plan.module`` is ``model``, the optimizer's parameters are its own), on several with
``plan_on_rank0`` (one plan for every DDP rank, each with its own planned module sharing ``model``'s parameters).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from planner.options import PlanOptions


def plan_with(accelerator: Any, model: nn.Module, budget: int | str, *, inputs: Any, optimizer: Any = None,
              options: PlanOptions | None = None, **overrides: Any) -> Any:
    """Plans ``model`` for the step ``accelerator`` runs; returns the ``Plan``, whose ``module`` the loop trains.

    Args:
        accelerator: the loop's ``accelerate.Accelerator``.
        model: the model, before ``accelerator.prepare``.
        budget: peak memory of one training step on one device (``"22GB"``, ``"60%"``, bytes).
        inputs: one batch as the loop calls the model with it (a dict of keyword arguments or a tuple).
        optimizer: the loop's optimizer (its state and step are counted), or None.
        options, **overrides: ``PlanOptions`` fields (``loss_fn``, ``keep_output``...); the accelerator's
            settings override them.
    """
    settings = {**overrides, "optimizer": optimizer,
                "gradient_accumulation_steps": int(accelerator.gradient_accumulation_steps),
                "autocast": _autocast(str(getattr(accelerator, "mixed_precision", "no")))}
    backend = _backend(accelerator)
    if backend is not None and accelerator.num_processes > 1:  # one plan for every rank: the eager step's
        settings["compilable"] = True
    elif backend is not None:
        settings["compile_backend"] = backend
    if accelerator.num_processes > 1:
        from planner.distributed.rank import plan_on_rank0

        return plan_on_rank0(model, budget, inputs=inputs, options=options, parallel="ddp", **settings)
    from planner.inplace import enable

    return enable(model, budget, inputs=inputs, options=options, **settings)


def _backend(accelerator: Any) -> str | None:
    """The torch.compile backend ``accelerator.prepare`` compiles the model with (its dynamo plugin's, by the name
    torch.compile takes), None when it does not compile."""
    plugin = getattr(getattr(accelerator, "state", None), "dynamo_plugin", None)
    backend = getattr(plugin, "backend", None)
    name = None if backend is None else str(getattr(backend, "value", backend)).lower()
    return None if name in (None, "no") else name


def _autocast(mixed_precision: str) -> str | None:
    """accelerate's ``mixed_precision`` as ``autocast=``: ``bf16`` and ``fp16`` are names the option takes
    (``planner.options.AUTOCAST_DTYPES``); ``no`` and ``fp8`` (not torch.autocast) plan without."""
    return mixed_precision if mixed_precision in ("bf16", "fp16") else None
