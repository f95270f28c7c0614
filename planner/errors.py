"""Exceptions a user of ckplan can catch, each saying what went wrong and how to fix it.

Every mistake of the caller is a ``PlannerError``; the CLI maps exactly these to exit code 2 and
treats anything else as a bug in ckplan. Each subclass for a malformed argument also subclasses
the builtin it replaced (``BudgetError`` is a ``ValueError``), so ``except ValueError`` still works.
"""

from __future__ import annotations

import os
import traceback
from typing import TYPE_CHECKING

from planner.common.units import format_bytes

if TYPE_CHECKING:
    from planner.memory.breakdown import PeakBreakdown


class PlannerError(Exception):
    """Base class of every error ckplan raises on purpose."""


class BudgetError(PlannerError, ValueError):
    """A budget that is not in one of the accepted forms, or not positive."""


class OptionError(PlannerError, ValueError):
    """An option of ``optimize``/``ckplan`` that cannot be used: an unknown solver, device, engine or
    optimizer, a value out of range, options that exclude each other, a pattern that matches nothing."""


class InputError(PlannerError, TypeError):
    """An argument of the wrong kind: no example inputs, inputs that are not tensors, a ``profile=``
    that is not a profile."""


class CaptureError(PlannerError):
    """The model could not be turned into a graph."""


class ProfileError(PlannerError):
    """The model failed while running one of its nodes on the example inputs."""


class CompileError(PlannerError):
    """The model, or ckplan's plan of it, does not compile with the ``torch.compile`` backend the step runs under
    (``compile_backend``): raised while planning, before any training step."""


class ProfileMismatch(PlannerError, ValueError):
    """A saved profile was given for a model or inputs it was not made from (says what differs)."""


class ProfileFileError(PlannerError, ValueError):
    """A profile or device-spec file cannot be read: missing, not JSON, or of an unknown schema."""


class PlanFileError(PlannerError, ValueError):
    """A plan file cannot be read: not JSON, not a ckplan plan, or of an unknown version."""


class PlanMismatch(PlannerError, ValueError):
    """A plan was applied to a model that does not trace to the graph it was made for."""


class TorchVersionError(PlannerError, ImportError):
    """The installed torch lacks a private entry point ckplan relies on (``planner.compat``): the message
    names the torch version, what is missing and the range of torch releases ckplan is tested on."""


class OutOfTime(PlannerError):
    """The solve stage's time limit (``time_limit_s``, ``ckplan --time-limit``) ran out before any plan
    that fits was found. Nothing is proven about the budget: a larger limit may find one."""


class InfeasibleBudget(PlannerError):
    """No checkpointing plan fits the budget.

    Attributes:
        budget_bytes: the budget that was asked for.
        min_peak_bytes: the smallest peak any plan reaches under the cost model; None when no plan
            satisfies the constraints at all (contradictory ``must_save``/``must_recompute``).
        breakdown: what that smallest peak is made of (``planner.memory.simulate.PeakBreakdown``);
            None when there is no smallest peak.
        reason: what makes the budget infeasible when it is not the model itself (the user's
            overrides), else ``""``; it opens the message.
        max_chunks: None when infeasibility is proven over every admissible cut position; else the
            most chunks that were tried: plans among finer chunks were not searched, and
            ``min_peak_bytes`` is the smallest peak found (an upper bound on the true one).
        setting: what the plan was for when it is not one device measured here (one rank of an FSDP2 job,
            a device spec, a step profiled in pieces), and what else can change; it closes the message.
    """

    def __init__(self, budget_bytes: int, min_peak_bytes: int | None, breakdown: PeakBreakdown | None = None,
                 reason: str = "", max_chunks: int | None = None, setting: str = ""):
        self.budget_bytes = budget_bytes
        self.min_peak_bytes = min_peak_bytes
        self.breakdown = breakdown
        self.reason = reason
        self.max_chunks = max_chunks
        self.setting = setting
        budget = format_bytes(budget_bytes)
        if min_peak_bytes is None:
            message = (f"no checkpointing plan satisfies the constraints at any budget, so the smallest "
                       f"reachable peak is unknown (budget {budget})")
        else:
            smallest = format_bytes(min_peak_bytes)
            parts = ", ".join(f"{label} {format_bytes(getattr(breakdown, name))}"
                              for name, label in breakdown.LABELS.items() if getattr(breakdown, name)) \
                if breakdown else ""
            if breakdown and breakdown.largest_kept:
                parts += "; largest kept activations: " + ", ".join(f"{node} {format_bytes(nbytes)}"
                                                                    for node, nbytes in breakdown.largest_kept)
            message = (f"budget {budget} is below the smallest peak any checkpointing plan reaches, {smallest}"
                       f"{f' ({parts})' if parts else ''}; raise the budget to at least {smallest} or shrink the batch")
        if max_chunks is not None:
            message = (f"not proven: no plan within {max_chunks} chunks (cut positions) fits, but the model has "
                       f"more; plan with max_chunks={2 * max_chunks} (ckplan --max-chunks {2 * max_chunks}) to "
                       f"search finer plans. Among these chunks: {message}")
        if setting:
            message = f"{message} (planned for {setting})"
        super().__init__(f"{reason}: {message}" if reason else message)

    def planned_for(self, setting: str) -> InfeasibleBudget:
        """This error with ``setting`` (what the plan was for) put before the setting it has."""
        return InfeasibleBudget(self.budget_bytes, self.min_peak_bytes, self.breakdown, self.reason, self.max_chunks,
                                "; ".join(s for s in (setting, self.setting) if s))

    @property
    def proven(self) -> bool:
        """Whether no plan over every admissible cut position fits (else only those tried were searched)."""
        return self.max_chunks is None

    def __reduce__(self):  # pickles with its fields (a rank sends it to the others), not its message
        return type(self), (self.budget_bytes, self.min_peak_bytes, self.breakdown, self.reason, self.max_chunks,
                            self.setting)


_PLANNER_DIR = os.path.dirname(os.path.abspath(__file__))


def in_library(filename: str) -> bool:
    """Whether ``filename`` is ckplan's, torch's, the standard library's or an installed package's code
    (or not a file at all: ``<string>``), so not the user's own."""
    import sysconfig

    import torch  # only callers that caught a torch error get here

    path = os.path.abspath(filename)
    torch_dir = os.path.dirname(os.path.dirname(os.path.abspath(torch.__file__)))
    stdlib = os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep
    return (filename.startswith("<") or path.startswith((_PLANNER_DIR, torch_dir, stdlib))
            or "site-packages" in path or "dist-packages" in path)


def user_frame(exc: BaseException) -> str | None:
    """``file:line: code`` of the innermost traceback frame in the user's own code."""
    found = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if not in_library(frame.filename):
            found = f"{frame.filename}:{frame.lineno}: {(frame.line or '').strip()}"
    return found
