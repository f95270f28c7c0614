"""Planning the user's own model object in place, the way ``gradient_checkpointing_enable()`` does.

``enable(model, budget, inputs=...)`` plans ``model`` and puts the plan's hooks on it: the object the
user holds, with every method, optimizer and ``Trainer`` that already refers to it, now checkpoints
its training steps as planned. ``disable(model)`` takes the hooks off again. The plan always runs the
model's own forward (module hooks, ``planner.rewrite.chains``), so its segments are chains of module
calls even where torch.fx could trace the model.
"""

from __future__ import annotations

from torch import nn
from typing_extensions import Unpack

from planner.capture.method import ExecutorKind
from planner.common.budget import check_budget
from planner.compiled.step import fit_step
from planner.options import OptionArgs, PlanOptions, resolve
from planner.pipeline import UserInputs, plan_for, prepare
from planner.plan import Plan
from planner.rewrite.modules import remove_plan


def enable(model: nn.Module, budget: int | str, *, inputs: UserInputs = None, options: PlanOptions | None = None,
           **overrides: Unpack[OptionArgs]) -> Plan:
    """Plans ``model`` for ``budget`` and applies the plan to ``model`` itself (``plan.module is model``).

    Takes the arguments of ``optimize`` (``inputs=``, ``options=``, ``loss_fn=``, ``keep_output=``...). A model
    already planned in place is planned again from scratch: its old hooks come off first (the real
    forward that is recorded must not run them), and stay off if planning fails. Otherwise a failed
    call leaves the model as it was.

    Raises:
        PlannerError: everything ``optimize`` raises (``InfeasibleBudget``, ``OptionError``...).
        OptionError: ``world_size`` or ``device``, which plan for another machine (use ``optimize`` for those).
    """
    opts = resolve(options, overrides, where="enable")
    check_budget(budget)
    remove_plan(model)  # profile the model as it is, without an older plan's hooks
    prepared = prepare(model, inputs=inputs, options=opts, budget=budget, runs=ExecutorKind.HOOKS)
    if opts.compile_backend is not None:  # the compiled step, measured: planner.compiled.step
        return fit_step(prepared, budget, target=model)
    return plan_for(prepared, budget, target=model)


def disable(model: nn.Module) -> bool:
    """Takes the hooks ``enable`` (or any plan that runs the model's own forward) put on ``model`` off
    again; True if there were any. The model then trains without checkpointing."""
    return remove_plan(model)
