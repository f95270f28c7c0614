"""How a graph was captured, and so how its plan runs: the capture tiers as an enum (torch-free, so the
profile's record can hold it too).

Each ``CaptureMethod`` names the executor its plans run with (``ExecutorKind``): a graph torch.fx traced
can be rewritten; a graph of ATen ops is only profiled, and the plan runs the model's own forward with
module hooks. ``planner.capture.api.TIERS`` tries them in order; ``planner.rewrite.executor.executor_for``
builds the executor a method names. This table is the only place a method's consequences are written.
The value is short and stable, for JSON; ``label`` is the sentence reports show.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ExecutorKind(str, enum.Enum):
    """How a plan runs. A ``str`` (its value)."""

    GRAPH = "graph"
    """A generated subclass whose forward is the rewritten graph (``planner.rewrite.graph``)."""
    HOOKS = "hooks"
    """The model's own forward, with checkpoints entered and left by module hooks (``planner.rewrite.chains``)."""

    def __str__(self) -> str:
        return self.value


class CaptureMethod(str, enum.Enum):
    """Which capture tier produced the graph. A ``str`` (its value), so JSON holds ``"fx"``."""

    FX = "fx"
    """``torch.fx.symbolic_trace``: user modules inlined, torch.nn layers kept as calls."""
    ATEN = "aten"
    """The ATen ops one real forward on the example inputs dispatches (``make_fx``), with their module
    calls: what eager execution does."""
    EXPORT = "export"
    """``torch.export.export(..., strict=False)`` on the example inputs: an ATen graph (models on the
    meta device, which cannot run a real forward)."""
    FX_BLOCKS = "fx_blocks"
    """fx with the model's repeated blocks kept as opaque calls (code neither tier above traces)."""
    FX_UNITS = "fx_units"
    """fx with the FSDP units kept as calls, so FSDP2's hooks run (distributed plans)."""

    def __str__(self) -> str:
        return self.value

    @property
    def label(self) -> str:
        """The human sentence reports show (``torch.fx.symbolic_trace``...)."""
        return _TRAITS[self].label

    @property
    def executor(self) -> ExecutorKind:
        """How plans of a graph captured this way run."""
        return _TRAITS[self].executor

    @property
    def eager_locals(self) -> bool:
        """Whether the profile measures what the model's own forward keeps alive beyond the graph (its
        Python locals): for graphs of a model that runs for real and whose graph nodes are single ops (not
        for a meta model's export, nor for graphs with opaque block or unit calls)."""
        return _TRAITS[self].eager_locals


@dataclass(frozen=True, slots=True)
class _Traits:
    label: str
    executor: ExecutorKind
    eager_locals: bool


_TRAITS = {
    CaptureMethod.FX: _Traits("torch.fx.symbolic_trace", ExecutorKind.GRAPH, True),
    CaptureMethod.ATEN: _Traits("ATen ops of one eager forward (make_fx), run as module hooks", ExecutorKind.HOOKS,
                                True),
    CaptureMethod.EXPORT: _Traits("torch.export (non-strict)", ExecutorKind.HOOKS, False),
    CaptureMethod.FX_BLOCKS: _Traits("torch.fx.symbolic_trace (blocks as opaque calls)", ExecutorKind.GRAPH, False),
    CaptureMethod.FX_UNITS: _Traits("torch.fx.symbolic_trace (FSDP units as calls)", ExecutorKind.GRAPH, False),
}
