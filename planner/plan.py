"""The result handed to the user: what is checkpointed, what it costs, and the module that runs it.

A ``Plan`` is plain data plus ``module``; it saves to JSON and re-applies to a
fresh instance of the same architecture (checked by graph fingerprint).
"""

from __future__ import annotations

import html
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from torch import nn

from planner.budget import format_bytes
from planner.capture.api import EXPORT, capture
from planner.capture.inputs import as_inputs
from planner.rewrite.graph import SegmentSpec, rewrite

FORMAT = "ckplan-plan"
VERSION = 1


@dataclass(frozen=True, kw_only=True, slots=True)
class Segment:
    """One checkpointed run of the graph."""

    nodes: tuple[str, ...]
    """Graph node names, in order."""
    module_paths: tuple[str, ...]
    """Modules whose calls lie wholly inside, outermost first; ``path:op`` for loose ops."""
    recompute_ms: float
    """Forward time re-run in backward, ms."""
    freed_bytes: int = 0
    """Activation bytes it stops keeping until backward, net of the inputs it keeps."""
    restore_buffers: tuple[str, ...] = ()
    """Buffers restored after recomputation (BatchNorm running statistics)."""
    saved_nodes: tuple[str, ...] = ()
    """Nodes whose outputs are kept, not re-run (selective checkpointing inside the segment)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryTimeline:
    """Predicted live bytes during each node's forward and backward, with and without the plan."""

    nodes: tuple[str, ...]
    """Node names in forward order (the loss last); backward runs them in reverse."""
    forward_bytes: tuple[int, ...]
    backward_bytes: tuple[int | None, ...]
    """None for nodes that run nothing in backward."""
    baseline_forward_bytes: tuple[int, ...]
    baseline_backward_bytes: tuple[int | None, ...]


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A checkpointing plan for one model, budget and input shape.

    Attributes:
        module: the planned module (shares parameters and buffers with the model);
            None for a plan loaded from JSON until ``apply`` is called.
    """

    module: nn.Module | None = field(repr=False, compare=False)
    budget_bytes: int
    predicted_peak_bytes: int
    """Peak of one training step under the plan, from the memory model."""
    baseline_peak_bytes: int
    """Predicted peak without checkpointing."""
    predicted_overhead: float
    """Recompute time / un-checkpointed step time (0.0 for the empty plan)."""
    recompute_ms: float
    step_ms: float
    """Measured time of one un-checkpointed step, ms."""
    segments: tuple[Segment, ...]
    solver_status: str
    """``OPTIMAL`` (proven under the cost model) or ``FEASIBLE`` (time limit hit)."""
    solve_time_s: float
    recompute_bound_ms: float = 0.0
    """Proven lower bound on the recompute time of any plan that fits the budget (``recompute_ms``
    itself when OPTIMAL; 0 when nothing is proven, e.g. a fixed baseline's plan)."""
    fingerprint: str
    """Structure hash of the traced graph the plan refers to."""
    capture_method: str
    capture_notes: tuple[str, ...] = ()
    """Why earlier capture methods failed, one line each."""
    device: str
    source: str = field(default="", repr=False)
    """Python source of the planned module's generated class."""
    peak_breakdown: dict[str, int] = field(default_factory=dict, repr=False)
    """What the predicted peak is made of, bytes per component."""
    largest_kept: tuple[tuple[str, int, str], ...] = field(default=(), repr=False)
    """Largest activations alive at the predicted peak: (producing node, bytes, why it stays)."""
    timeline: MemoryTimeline | None = field(default=None, repr=False)
    """Predicted memory over one step, for plots."""

    def apply(self, model: nn.Module, *, inputs=None) -> nn.Module:
        """Returns ``model`` rewritten to run this plan (``model`` itself is not modified).

        Args:
            model: a fresh instance of the architecture the plan was made for.
            inputs: example inputs, needed when the plan was captured with torch.export
                (default ``model.example_inputs``).

        Raises:
            ValueError: ``model`` does not trace to the graph the plan was made for.
        """
        example = as_inputs(model, inputs) if inputs is not None or hasattr(model, "example_inputs") else None
        if self.capture_method == EXPORT and example is None:
            raise TypeError("this plan was captured with torch.export: pass inputs= (the example inputs) to apply()")
        captured = capture(model, example)
        if captured.fingerprint != self.fingerprint:
            raise ValueError(
                f"this plan was made for a graph with fingerprint {self.fingerprint}, but "
                f"{type(model).__name__} traces to {captured.fingerprint}: apply it to the same architecture "
                "and configuration, or plan again"
            )
        specs = [SegmentSpec(nodes=s.nodes, restore_buffers=s.restore_buffers, saved_nodes=s.saved_nodes)
                 for s in self.segments]
        return rewrite(model, captured, specs).module

    def summary(self) -> str:
        """A human-readable table of the plan."""
        lines = [
            f"ckplan: {len(self.segments)} checkpointed segment(s), solver {self.solver_status} "
            f"in {self.solve_time_s:.2f} s (capture: {self.capture_method}, device: {self.device})",
            f"peak {format_bytes(self.baseline_peak_bytes)} -> {format_bytes(self.predicted_peak_bytes)} "
            f"(budget {format_bytes(self.budget_bytes)}), recompute {self.recompute_ms:.2f} ms per step "
            f"= +{100 * self.predicted_overhead:.1f}% of a {self.step_ms:.2f} ms step",
        ]
        lines += [f"  ({note.splitlines()[0][:160]})" for note in self.capture_notes]
        if self.segments:
            width = max(len(_describe(s)) for s in self.segments)
            lines.append(f"  {'#':>3}  {'segment':<{width}}  {'nodes':>5}  {'saved':>5}  {'recompute':>10}")
            for i, seg in enumerate(self.segments):
                lines.append(f"  {i:>3}  {_describe(seg):<{width}}  {len(seg.nodes):>5}  {len(seg.saved_nodes):>5}  "
                             f"{seg.recompute_ms:>7.2f} ms")
        else:
            lines.append("  nothing checkpointed: the model already fits the budget")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready description (everything but the module)."""
        data = {"format": FORMAT, "version": VERSION}
        for name in ("budget_bytes", "predicted_peak_bytes", "baseline_peak_bytes", "predicted_overhead",
                     "recompute_ms", "step_ms", "solver_status", "solve_time_s", "recompute_bound_ms", "fingerprint",
                     "capture_method", "capture_notes", "device", "source", "peak_breakdown"):
            data[name] = getattr(self, name)
        data["largest_kept"] = [list(item) for item in self.largest_kept]
        data["timeline"] = None if self.timeline is None else {k: list(v) for k, v in asdict(self.timeline).items()}
        data["segments"] = [asdict(s) for s in self.segments]
        return data

    def save(self, path: str | Path) -> None:
        """Writes ``to_dict()`` as JSON; read it back with ``load_plan``."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    def _repr_html_(self) -> str:
        """A notebook summary: the plan's numbers and its checkpointed segments."""
        numbers = [
            ["predicted peak", f"{format_bytes(self.baseline_peak_bytes)} → {format_bytes(self.predicted_peak_bytes)}"],
            ["budget", format_bytes(self.budget_bytes)],
            ["overhead", f"+{100 * self.predicted_overhead:.1f}% ({self.recompute_ms:.2f} ms per "
                         f"{self.step_ms:.2f} ms step)"],
            ["solver", f"{self.solver_status} in {self.solve_time_s:.2f} s"],
            ["device", self.device],
        ]
        segments = [[str(i), ", ".join(s.module_paths), str(len(s.nodes)), format_bytes(s.freed_bytes),
                     f"{s.recompute_ms:.2f} ms"] for i, s in enumerate(self.segments)]
        parts = [f"<div><p><b>ckplan plan</b>: {len(self.segments)} checkpointed segment(s)</p>",
                 html_table(["", ""], numbers)]
        if segments:
            parts.append(html_table(["#", "modules", "nodes", "frees", "recompute"], segments))
        else:
            parts.append("<p>nothing checkpointed: the model already fits the budget</p>")
        return "".join(parts) + "</div>"

    def __repr__(self) -> str:
        return (f"Plan(segments={len(self.segments)}, peak {format_bytes(self.predicted_peak_bytes)} of budget "
                f"{format_bytes(self.budget_bytes)}, overhead +{100 * self.predicted_overhead:.1f}%, "
                f"{self.solver_status})")


def _describe(segment: Segment) -> str:
    paths = segment.module_paths
    return ", ".join(paths) if len(paths) <= 3 else f"{paths[0]} ... {paths[-1]} ({len(paths)} parts)"


def load_plan(path: str | Path) -> Plan:
    """Reads a plan written by ``Plan.save``; call ``.apply(model)`` to get the module.

    Raises:
        ValueError: the file is not a ckplan plan, or of an unknown version.
    """
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}); pass a file written by Plan.save") from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path} is not a ckplan plan; pass a file written by Plan.save")
    if data.get("version") != VERSION:
        raise ValueError(f"{path} has plan version {data.get('version')}, this ckplan reads version {VERSION}")
    fields = {k: v for k, v in data.items() if k not in ("format", "version", "segments", "largest_kept", "timeline")}
    segments = tuple(
        Segment(nodes=tuple(s["nodes"]), module_paths=tuple(s["module_paths"]), recompute_ms=s["recompute_ms"],
                freed_bytes=s.get("freed_bytes", 0), restore_buffers=tuple(s.get("restore_buffers", ())),
                saved_nodes=tuple(s.get("saved_nodes", ())))
        for s in data["segments"]
    )
    largest = tuple(tuple(item) for item in data.get("largest_kept", ()))
    timeline = data.get("timeline")
    if timeline is not None:
        timeline = MemoryTimeline(**{k: tuple(v) for k, v in timeline.items()})
    fields["capture_notes"] = tuple(fields.get("capture_notes", ()))
    return Plan(module=None, segments=segments, largest_kept=largest, timeline=timeline, **fields)


def html_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """An HTML table of escaped text cells (the notebook summaries of plans and trade-offs)."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
