"""``optimize()``: plans a model for a budget, the whole pipeline (``planner.pipeline``), or for a step run under
torch.compile, fitted to that step as measured (``planner.compiled.step``)."""

from __future__ import annotations

from torch import nn
from typing_extensions import Unpack

from planner.common.budget import check_budget
from planner.compiled.step import fit_step
from planner.options import OptionArgs, PlanOptions, resolve
from planner.pipeline import UserInputs, plan_for, prepare
from planner.plan import Plan
from planner.solve.registry import get_solver


def optimize(model: nn.Module, budget: int | str, *, inputs: UserInputs = None, options: PlanOptions | None = None,
             **overrides: Unpack[OptionArgs]) -> Plan:
    """Plans activation checkpointing so one training step of ``model`` fits ``budget``.

    Args:
        model: the model to train (not modified; ``plan.module`` shares its parameters).
        budget: peak memory of one training step: int bytes, ``"4GB"``, ``"4GiB"``,
            ``"512MB"``, ``"512MiB"`` or ``"60%"`` of the un-checkpointed peak.
        inputs: positional arguments (tuple) or keyword arguments (dict) for ``model``;
            default ``model.example_inputs``.
        options: a ``PlanOptions`` (``loss_fn``, ``time_limit_s``, ``device``, ``world_size``...; every
            field is documented there).
        **overrides: any ``PlanOptions`` field as a keyword argument, applied over ``options``:
            ``optimize(model, "60%", inputs=(x,), loss_fn=loss_fn, keep_output=False)``.

    Returns:
        The least-recompute ``Plan`` whose predicted peak fits the budget; with ``compile_backend``, the one whose
        compiled step measured fits it (``Plan.compiled_step``).

    Raises:
        InfeasibleBudget: no plan fits (under the overrides); carries the smallest reachable peak.
        OutOfTime: no plan was found within ``time_limit_s`` (a PlannerError; nothing is proven).
        BudgetError: a malformed budget. OptionError: an unknown option, solver or device, a pattern matching
            nothing, options that exclude each other. InputError: no inputs. (All are PlannerErrors;
            the first two are ValueErrors, InputError a TypeError.)
        CaptureError, ProfileError: the model could not be traced or run.

    Example:
        >>> plan = optimize(model, "60%", inputs=(x,))          # doctest: +SKIP
        >>> loss_fn(plan.module(x)).backward()                   # doctest: +SKIP
    """
    opts = resolve(options, overrides, where="optimize")
    check_budget(budget)  # reject a malformed budget before any work
    get_solver(opts.solver)  # reject an unknown solver before any work
    prepared = prepare(model, inputs=inputs, options=opts, budget=budget)
    if opts.compile_backend is not None:  # the compiled step, measured: planner.compiled.step
        return fit_step(prepared, budget)
    return plan_for(prepared, budget, options=opts)
