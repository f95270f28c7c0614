"""``ckplan model.py --budget 75%``: plan a model file from the terminal.

The model file defines module-level ``model`` (an nn.Module or a zero-argument
callable returning one), ``inputs`` (tuple or dict, or a callable returning one)
and optionally ``loss_fn(output) -> scalar``. Exit codes: 0 success, 2 user
error (bad flag, budget or model file), 3 infeasible budget.
"""

from __future__ import annotations

import argparse
import runpy
import sys
import traceback
from pathlib import Path

from torch import nn

from planner.budget import ACCEPTED_FORMS
from planner.errors import InfeasibleBudget, PlannerError

EXIT_USAGE, EXIT_INFEASIBLE = 2, 3


class UserError(Exception):
    """A mistake in the command line or the model file: one line, exit code 2."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ckplan", description="Plan activation checkpointing for a PyTorch model.")
    parser.add_argument("model_file", help="Python file defining `model`, `inputs` and optionally `loss_fn`")
    parser.add_argument("--budget", default="75%", help=f"peak memory of a training step: {ACCEPTED_FORMS}")
    parser.add_argument("--time-limit", type=float, default=30.0, help="solver time limit in seconds")
    parser.add_argument("--save", metavar="PLAN.json", help="write the plan as JSON (read it with load_plan)")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    return parser


def load_model_file(path: str) -> tuple[nn.Module, object, object]:
    """Runs the model file and returns its ``model``, ``inputs`` and ``loss_fn`` (or None)."""
    if not Path(path).is_file():
        raise UserError(f"model file {path} does not exist")
    try:
        namespace = runpy.run_path(path, run_name="__ckplan_model__")
    except Exception as exc:  # noqa: BLE001 - any failure in the user's file is a user error
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        raise UserError(f"{frame.filename}:{frame.lineno}: {type(exc).__name__}: {exc}") from exc
    values = []
    for name in ("model", "inputs"):
        if name not in namespace:
            raise UserError(f"{path} defines no `{name}`; define a module-level `{name}`")
        value = namespace[name]
        if callable(value) and not isinstance(value, nn.Module):
            value = value()
        values.append(value)
    if not isinstance(values[0], nn.Module):
        raise UserError(f"`model` in {path} is a {type(values[0]).__name__}, not an nn.Module")
    return values[0], values[1], namespace.get("loss_fn")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        from planner.optimize import optimize

        model, inputs, loss_fn = load_model_file(args.model_file)
        plan = optimize(model, args.budget, inputs=inputs, loss_fn=loss_fn, time_limit_s=args.time_limit)
    except InfeasibleBudget as exc:
        print(f"ckplan: infeasible: {exc}", file=sys.stderr)
        return EXIT_INFEASIBLE
    except (UserError, PlannerError, ValueError, TypeError) as exc:
        if args.debug:
            traceback.print_exc()
        print(f"ckplan: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(plan.summary())
    if args.save:
        plan.save(args.save)
        print(f"plan saved to {args.save}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
