"""The forward of a plan's segment that is one module call, as compiled code runs it.

A plan run by module hooks enters and leaves each segment in hooks of its first and last module calls: eager code
runs that, dynamo cannot trace it. A segment of one module call also gets a forward of its own on that module
(``CheckpointedForward``): in compiled code it runs the module's forward through ``torch.utils.checkpoint``, as
Hugging Face's ``GradientCheckpointingLayer`` does, which dynamo traces into one graph and AOTAutograd's partitioner
re-runs in backward; in eager code it is the module's forward and the hooks checkpoint it.
"""

from __future__ import annotations

from collections.abc import Callable
from types import MethodType
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from planner.capture.cache import training_with_grad
from planner.errors import PlannerError


class CompiledChainError(PlannerError, RuntimeError):
    """A segment torch.compile cannot run was called in compiled code."""


class Segment(Protocol):
    """What a ``CheckpointedForward`` needs of its segment (``planner.rewrite.chains``' runner)."""

    members: list[nn.Module]

    @property
    def random(self) -> bool:
        """Whether its forward draws random numbers (the RNG state is stashed to re-run it alike)."""
        ...

    def compiled_contexts(self) -> Callable[[], tuple]:
        """Its ``context_fn`` under torch.compile (kept ops by SAC's policy, or every op re-run)."""
        ...


@torch.compiler.disable
def refuse_compiled(segment: str) -> None:
    """A segment torch.compile cannot run, called in compiled code: the step stops before it runs, in one line that
    says what to do (run eagerly, so that the error reaches the caller rather than a graph break)."""
    raise CompiledChainError(f"{segment}: torch.compile cannot run a segment of several module calls, or of one "
                             "call among many; plan with compilable=True (ckplan --compilable), whose segments are "
                             "one module call each, or train this plan without torch.compile")


class CheckpointedForward:
    """The ``forward`` attribute of the module of a segment of one call while its plan is installed: in eager code
    the module's own forward (the plan's hooks checkpoint it), in compiled code that forward through
    ``torch.utils.checkpoint``."""

    def __init__(self, segment: Segment, module: nn.Module | None = None, before: Any = None) -> None:
        self.segment = segment
        if module is None:  # installing: the segment's module, and the forward set on it already (a wrapper's)
            module, before = segment.members[0], segment.members[0].__dict__.get("forward")
            module.forward = self
        self.module, self.before = module, before

    def rebound(self, module: nn.Module) -> CheckpointedForward:
        """This forward for a clone of its module (``planner.capture.tree.clone_tree``), which runs the clone."""
        before = self.before
        if isinstance(before, MethodType) and before.__self__ is self.module:
            before = MethodType(before.__func__, module)
        return CheckpointedForward(self.segment, module, before)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        forward = self.before if self.before is not None else type(module).forward.__get__(module)
        if not torch.compiler.is_compiling() or not training_with_grad(module):
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=self.segment.random,
                          context_fn=self.segment.compiled_contexts(), **kwargs)

    def remove(self) -> None:
        """Puts the module's forward back as it was."""
        if self.module.__dict__.get("forward") is self:
            if self.before is None:
                del self.module.forward
            else:
                self.module.forward = self.before
