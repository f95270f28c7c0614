"""How a graph was captured: the tiers of ``planner.capture.api.capture`` as an enum (torch-free, so
the profile's record can hold it too).

The value is short and stable, for JSON; ``label`` is the sentence reports show.
"""

from __future__ import annotations

import enum


class CaptureMethod(str, enum.Enum):
    """Which capture tier produced the graph. A ``str`` (its value), so JSON holds ``"fx"``."""

    FX = "fx"
    """``torch.fx.symbolic_trace``: user modules inlined, torch.nn layers kept as calls."""
    ATEN = "aten"
    """The ATen ops one real forward on the example inputs dispatches (``make_fx``), with their module
    calls: what eager execution does. The plan runs the model's own forward (``planner.rewrite.executor``)."""
    EXPORT = "export"
    """``torch.export.export(..., strict=False)`` on the example inputs: an ATen graph (models on the
    meta device, which cannot run a real forward). The plan runs the model's own forward."""
    FX_BLOCKS = "fx_blocks"
    """fx with the model's repeated blocks kept as opaque calls (code neither tier above traces)."""
    FX_UNITS = "fx_units"
    """fx with the FSDP units kept as calls, so FSDP2's hooks run (distributed plans)."""

    def __str__(self) -> str:
        return self.value

    @property
    def label(self) -> str:
        """The human sentence reports show (``torch.fx.symbolic_trace``...)."""
        return _LABELS[self]


_LABELS = {
    CaptureMethod.FX: "torch.fx.symbolic_trace",
    CaptureMethod.ATEN: "ATen ops of one eager forward (make_fx), run as module hooks",
    CaptureMethod.EXPORT: "torch.export (non-strict)",
    CaptureMethod.FX_BLOCKS: "torch.fx.symbolic_trace (blocks as opaque calls)",
    CaptureMethod.FX_UNITS: "torch.fx.symbolic_trace (FSDP units as calls)",
}
