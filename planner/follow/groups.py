"""The plans of a family's shape groups (``GroupTable``): one ``GroupPlan`` per group, its table for people and
its JSON for ``Plan.save``."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from planner.common.checked_json import as_list, check_record, record_from_json
from planner.follow.shapes import Shapes
from planner.rewrite.offload_spec import OffloadSpec
from planner.rewrite.segment import Segment


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupPlan:
    """The plan of one group of call shapes."""

    shapes: Shapes
    """The group's upper shapes: what it was planned for."""
    segments: tuple[Segment, ...]
    """What it checkpoints (chains of module calls); empty when the un-checkpointed step fits."""
    predicted_peak_bytes: int
    baseline_peak_bytes: int
    """Predicted peak of the group's un-checkpointed step."""
    recompute_ms: float
    """Forward time re-run in backward per step, ms (scaled from the example's measured times)."""
    step_ms: float
    """Time of one un-checkpointed step at this shape, ms (scaled likewise)."""
    offload: OffloadSpec | None = None
    """The activations it copies to host memory and back (``docs/offload.md``); None: it keeps or re-runs each."""

    @property
    def overhead(self) -> float:
        """Re-runs and the copies the compute does not hide, as a share of the un-checkpointed step."""
        exposed = self.offload.exposed_ms if self.offload is not None else 0.0
        return (self.recompute_ms + exposed) / self.step_ms if self.step_ms else 0.0


class GroupTable(dict[Shapes, GroupPlan]):
    """Each group planned so far, by its upper shapes."""

    def rows(self) -> list[dict[str, Any]]:
        """One row per group, smallest first: its upper shapes, what it checkpoints, its predicted peak against
        its un-checkpointed one, and its recompute as a share of its step."""
        return [{"shapes": dict(group.shapes), "segments": len(group.segments),
                 "predicted_peak_bytes": group.predicted_peak_bytes, "baseline_peak_bytes": group.baseline_peak_bytes,
                 "recompute_ms": group.recompute_ms, "step_ms": group.step_ms,
                 "offloaded_bytes": group.offload.offloaded_bytes if group.offload is not None else 0,
                 "overhead": group.overhead}
                for group in sorted(self.values(), key=lambda g: [math.prod(s) for _, s in g.shapes])]

    def to_json(self) -> list[dict[str, Any]]:
        """The groups as JSON (``from_json`` reads them back)."""
        return [{"shapes": [[name, list(shape)] for name, shape in key],
                 "segments": [asdict(s) for s in group.segments],
                 "predicted_peak_bytes": group.predicted_peak_bytes, "baseline_peak_bytes": group.baseline_peak_bytes,
                 "recompute_ms": group.recompute_ms, "step_ms": group.step_ms,
                 "offload": None if group.offload is None else asdict(group.offload)} for key, group in self.items()]

    @classmethod
    def from_json(cls, data: Any, where: str = "plan.family.groups") -> GroupTable:
        """The groups ``to_json`` wrote.

        Raises:
            TypeError, ValueError, KeyError: a malformed field, named from ``where``.
        """
        table = cls()
        for i, raw in enumerate(as_list(data, where)):
            key = tuple((str(name), tuple(shape)) for name, shape in raw["shapes"])
            segments = tuple(record_from_json(Segment, s, f"{where}[{i}].segments[{j}]")
                             for j, s in enumerate(as_list(raw["segments"], f"{where}[{i}].segments")))
            offload = raw.get("offload")
            if offload is not None:
                offload = OffloadSpec.from_dict(offload, f"{where}[{i}].offload")
            group = record_from_json(GroupPlan, {**raw, "shapes": key, "segments": segments, "offload": offload},
                                     f"{where}[{i}]")
            check_record(group, where=f"{where}[{i}]")
            table[key] = group
        return table
