"""Exceptions a user of ckplan can catch, each saying what went wrong and how to fix it."""

from __future__ import annotations

import os
import traceback


class PlannerError(Exception):
    """Base class of every error ckplan raises on purpose."""


class CaptureError(PlannerError):
    """The model could not be turned into a graph."""


class ProfileError(PlannerError):
    """The model failed while running one of its nodes on the example inputs."""


class ProfileMismatch(PlannerError, ValueError):
    """A saved profile was given for a model or inputs it was not made from (says what differs)."""


class ProfileFileError(PlannerError, ValueError):
    """A profile or device-spec file cannot be read: missing, not JSON, or of an unknown schema."""


class InfeasibleBudget(PlannerError):
    """No checkpointing plan fits the budget.

    Attributes:
        budget_bytes: the budget that was asked for.
        min_peak_bytes: the smallest peak any plan reaches under the cost model.
        breakdown: what that smallest peak is made of, bytes per component.
    """

    def __init__(self, budget_bytes: int, min_peak_bytes: int, breakdown: dict[str, int]):
        self.budget_bytes = budget_bytes
        self.min_peak_bytes = min_peak_bytes
        self.breakdown = dict(breakdown)
        parts = ", ".join(f"{k} {_fmt(v)}" for k, v in breakdown.items() if v)
        super().__init__(
            f"budget {_fmt(budget_bytes)} is below the smallest peak any checkpointing "
            f"plan reaches, {_fmt(min_peak_bytes)} ({parts}); raise the budget to at least "
            f"{_fmt(min_peak_bytes)} or shrink the batch"
        )


def _fmt(nbytes: int) -> str:
    from planner.budget import format_bytes

    return format_bytes(nbytes)


_PLANNER_DIR = os.path.dirname(os.path.abspath(__file__))


def user_frame(exc: BaseException) -> str | None:
    """``file:line: code`` of the innermost traceback frame in the user's own code."""
    import torch  # only callers that caught a torch error get here

    torch_dir = os.path.dirname(os.path.dirname(os.path.abspath(torch.__file__)))
    found = None
    for frame in traceback.extract_tb(exc.__traceback__):
        path = os.path.abspath(frame.filename)
        if path.startswith(_PLANNER_DIR) or path.startswith(torch_dir) or frame.filename.startswith("<"):
            continue
        if "site-packages" in path or "dist-packages" in path:
            continue
        found = f"{frame.filename}:{frame.lineno}: {(frame.line or '').strip()}"
    return found
