"""What a predicted peak is made of, as typed fields; people read it through ``items()`` (torch-free).

The simulator fills it for every plan (``Timeline.breakdown``, ``Plan.peak_breakdown``) and
``InfeasibleBudget`` carries the smallest peak's, with the largest activations kept there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

LARGEST_PREFIX = "largest kept activation: "
"""Label of one ``largest_kept`` entry, followed by the producing node's name."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PeakBreakdown:
    """The components of one predicted peak; the four ``_bytes`` fields add up to it."""

    parameters_bytes: int
    """Parameters and buffers resident during the step (one rank's share in a distributed job)."""
    kept_activations_bytes: int
    """Activations kept for backward that are alive at the peak."""
    recomputed_activations_bytes: int
    """Activations a re-run segment holds again at the peak (0 for a forward peak)."""
    gradients_inputs_workspace_bytes: int
    """The rest: gradients, the model's inputs and outputs, and the transient memory of the op at the peak."""
    largest_kept: tuple[tuple[str, int], ...] = ()
    """Largest activations alive at the peak, as ``(producing node, bytes)``; only where an explanation
    asks for them (an infeasible budget), else empty."""

    LABELS: ClassVar[dict[str, str]] = {
        "parameters_bytes": "parameters and buffers",
        "kept_activations_bytes": "kept activations",
        "recomputed_activations_bytes": "recomputed activations",
        "gradients_inputs_workspace_bytes": "gradients, inputs and workspace",
    }
    """Field -> the label reports and JSON use (the sentences users have always seen)."""

    @property
    def total_bytes(self) -> int:
        """The peak itself: the sum of the four components."""
        return sum(getattr(self, name) for name in self.LABELS)

    def items(self) -> list[tuple[str, int]]:
        """``(label, bytes)`` in display order: the components, then each of ``largest_kept``."""
        return ([(label, getattr(self, name)) for name, label in self.LABELS.items()]
                + [(f"{LARGEST_PREFIX}{node}", nbytes) for node, nbytes in self.largest_kept])

    def to_dict(self) -> dict[str, int]:
        """The JSON form: labels to bytes (``from_dict`` reads it back)."""
        return dict(self.items())

    @classmethod
    def from_dict(cls, data: dict[str, int]) -> PeakBreakdown:
        """The breakdown ``to_dict`` wrote. Raises ValueError on a label it does not know."""
        by_label = {label: name for name, label in cls.LABELS.items()}
        values, largest = dict.fromkeys(cls.LABELS, 0), []
        for label, nbytes in data.items():
            if label.startswith(LARGEST_PREFIX):
                largest.append((label[len(LARGEST_PREFIX):], int(nbytes)))
            elif label in by_label:
                values[by_label[label]] = int(nbytes)
            else:
                raise ValueError(f"unknown peak component {label!r}")
        return cls(**values, largest_kept=tuple(largest))
