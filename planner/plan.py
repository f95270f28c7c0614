"""The result handed to the user: what is checkpointed, what it costs, and the module that runs it.

A ``Plan`` is plain data plus ``module``; it saves to JSON and re-applies to a
fresh instance of the same architecture (checked by graph fingerprint).
"""

from __future__ import annotations

import enum
import html
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Sequence

from torch import nn

from planner.budget import format_bytes
from planner.capture.api import capture
from planner.capture.inputs import as_inputs
from planner.capture.method import CaptureMethod
from planner.memory.breakdown import PeakBreakdown
from planner.profiling.devices import SacCostSource
from planner.solve.result import SolverStatus
from planner.rewrite.chains import Chain
from planner.rewrite.graph import SegmentSpec, rewrite
from planner.rewrite.modules import PlannedShapes, clone_tree, install_plan
from planner.errors import PlanFileError, PlanMismatch
from planner.records import INT_LIMIT, UNIT_LIMITS, as_list, as_tuple, check_record, read_json

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
    chain: tuple[str, ...] = ()
    """Plans that run the model's own forward (``capture_method.runs_modules``): the module calls the
    segment consists of, consecutive siblings in call order; empty for a rewritten graph."""
    saved_modules: tuple[str, ...] = ()
    """Plans that run the model's own forward: the modules (one op each) whose outputs are kept."""

    def spec(self) -> SegmentSpec:
        """What the graph rewriter needs to run this segment (its nodes, buffers to restore, saved nodes)."""
        return SegmentSpec(nodes=self.nodes, restore_buffers=self.restore_buffers, saved_nodes=self.saved_nodes)

    def chain_spec(self) -> Chain:
        """What the module executor needs to run this segment (its module calls, saves and buffers)."""
        return Chain(members=self.chain, saved_modules=self.saved_modules, restore_buffers=self.restore_buffers)


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryTimeline:
    """Predicted live bytes during each node's forward and backward, with and without the plan."""

    nodes: tuple[str, ...]
    """Node names in forward order (the loss last); backward runs them in reverse."""
    forward_bytes: tuple[int, ...]
    """Predicted peak bytes during each node's forward, under the plan."""
    backward_bytes: tuple[int | None, ...]
    """Predicted peak bytes during each node's backward, under the plan; None for nodes that run
    nothing in backward."""
    baseline_forward_bytes: tuple[int, ...]
    """As ``forward_bytes``, without checkpointing."""
    baseline_backward_bytes: tuple[int | None, ...]
    """As ``backward_bytes``, without checkpointing."""


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
    solver_status: SolverStatus
    """``OPTIMAL`` (proven under the cost model), ``FEASIBLE`` (time limit or Ctrl-C hit) or ``FIXED`` (a baseline)."""
    solve_time_s: float
    """Seconds the solve stage took: every strategy and finer chunking tried (what ``time_limit_s`` bounds)."""
    recompute_bound_ms: float | None = None
    """Proven lower bound on the recompute time of any plan that fits the budget (``recompute_ms``
    itself when OPTIMAL); None when nothing is proven, e.g. a fixed baseline's plan."""
    fingerprint: str
    """Structure hash of the traced graph the plan refers to."""
    capture_method: CaptureMethod
    """Which capture tier produced that graph (``.label`` is the sentence reports show)."""
    capture_notes: tuple[str, ...] = ()
    """Why earlier capture methods failed, one line each."""
    device: str
    source: str = field(default="", repr=False)
    """Python source of the planned module's generated class."""
    peak_breakdown: PeakBreakdown | None = field(default=None, repr=False)
    """What the predicted peak is made of (``.items()`` gives the labelled components)."""
    largest_kept: tuple[tuple[str, int, str], ...] = field(default=(), repr=False)
    """Largest activations alive at the predicted peak: (producing node, bytes, why it stays)."""
    timeline: MemoryTimeline | None = field(default=None, repr=False)
    """Predicted memory over one step, for plots."""
    sac_op_us: float | None = None
    """Per-op cost of selective checkpointing the plan was made with, microseconds (None: older file)."""
    sac_cost_source: SacCostSource | None = None
    """Where ``sac_op_us`` comes from: measured on the model, the device spec, or ckplan's default."""
    keep_output: bool = True
    """Whether the predicted peak assumes the loop keeps the model's output referenced through
    backward (``optimize(keep_output=...)``)."""
    planned_inputs: dict[str, tuple[int, ...]] = field(default_factory=dict, repr=False)
    """Shape of each tensor argument of the example call, by parameter name: a plan that runs the
    model's own forward warns once when a training call is larger (``planner.rewrite.modules``)."""

    def __post_init__(self) -> None:  # plain values (older JSON files, hand-made plans) become the types
        for name, convert in (("solver_status", SolverStatus), ("capture_method", CaptureMethod.parse),
                              ("sac_cost_source", SacCostSource), ("peak_breakdown", PeakBreakdown.from_dict)):
            value = getattr(self, name)
            if value is not None and isinstance(value, (str, dict)) and not isinstance(value, enum.Enum):
                object.__setattr__(self, name, convert(value))

    def apply(self, model: nn.Module, *, inputs=None) -> nn.Module:
        """Returns ``model`` rewritten to run this plan (``model`` itself is not modified).

        A plan that runs the model's own forward (``capture_method.runs_modules``: Hugging Face
        models and others torch.fx cannot trace) needs no inputs: it is a clone of ``model`` with the
        plan's hooks, and each chain checks on its first training forward that the model runs it.

        Args:
            model: a fresh instance of the architecture the plan was made for.
            inputs: example inputs for a model fx cannot trace without them (default
                ``model.example_inputs``); unused by plans that run the model's own forward.

        Raises:
            PlanMismatch (a ValueError): ``model`` does not trace to the graph the plan was made for.
            ChainError: a module-executor plan names a module ``model`` does not have.
        """
        if self.capture_method.runs_modules:
            module = clone_tree(model)
            install_plan(module, [s.chain_spec() for s in self.segments], planned=self.planned_shapes())
            return module
        example = as_inputs(model, inputs) if inputs is not None or hasattr(model, "example_inputs") else None
        captured = capture(model, example)
        if captured.fingerprint != self.fingerprint:
            raise PlanMismatch(
                f"this plan was made for a graph with fingerprint {self.fingerprint}, but "
                f"{type(model).__name__} traces to {captured.fingerprint}: apply it to the same architecture "
                "and configuration, or plan again"
            )
        return rewrite(model, captured, [s.spec() for s in self.segments]).module

    def planned_shapes(self) -> PlannedShapes | None:
        """What the shape warning of a module-executor plan compares calls with; None without shapes."""
        if not self.planned_inputs:
            return None
        fixed = self.peak_breakdown.parameters_bytes if self.peak_breakdown is not None else 0
        return PlannedShapes(shapes={k: tuple(v) for k, v in self.planned_inputs.items()},
                             predicted_peak_bytes=self.predicted_peak_bytes, fixed_bytes=fixed,
                             budget_bytes=self.budget_bytes)

    def summary(self) -> str:
        """A human-readable table of the plan."""
        lines = [
            f"ckplan: {len(self.segments)} checkpointed segment(s), solver {self.solver_status} "
            f"in {self.solve_time_s:.2f} s (capture: {self.capture_method.label}, device: {self.device})",
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
                     "capture_method", "capture_notes", "device", "source", "sac_op_us", "sac_cost_source",
                     "planned_inputs", "keep_output"):
            value = getattr(self, name)
            data[name] = value.value if isinstance(value, enum.Enum) else value  # enums as their short value
        data["peak_breakdown"] = None if self.peak_breakdown is None else self.peak_breakdown.to_dict()
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

    The file is plain JSON and is never executed; every field is checked against its type, fields this
    version does not know are ignored (newer optional fields). Files of this version written before the
    enums and the typed breakdown (``capture_method`` as a sentence, ``recompute_bound_ms`` 0 for
    "nothing proven") read as if written now.

    Raises:
        PlanFileError (a ValueError): the file cannot be read, is not a ckplan plan, is of an unknown
            version, or has a missing or malformed field; the message names the file and the field.
    """
    try:
        data = read_json(path)
    except OSError as exc:
        raise PlanFileError(f"cannot read plan {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise PlanFileError(f"{path} is not a ckplan plan: {exc}; pass a file written by Plan.save") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise PlanFileError(f"{path} is not a ckplan plan; pass a file written by Plan.save")
    if data.get("version") != VERSION:
        raise PlanFileError(f"{path} has plan version {data.get('version')!r}, this ckplan reads version {VERSION}")
    try:
        plan = _plan_from_dict(data)
        check_record(plan, where="plan", limits=_AMOUNTS, signed=("freed_bytes",))
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
        what = f"lacks the field {exc.args[0]!r}" if isinstance(exc, KeyError) else f"is malformed ({exc})"
        raise PlanFileError(f"{path} {what}; the file is incomplete or was edited: plan the model again") from None
    return plan


_AMOUNTS = dict.fromkeys(UNIT_LIMITS, INT_LIMIT)
"""A plan's amounts are reported, not computed with: any int64 (a budget of 10**18 bytes plans and saves)."""


def _plan_from_dict(data: dict[str, Any]) -> Plan:
    """The ``Plan`` (without its module) of ``to_dict``'s dict; lists become tuples, unknown keys are ignored."""
    known = {f.name for f in fields(Plan)} - {"module", "segments", "largest_kept", "timeline"}
    values = {k: v for k, v in data.items() if k in known}
    segments = tuple(_record(Segment, s, f"plan.segments[{i}]")
                     for i, s in enumerate(as_list(data["segments"], "plan.segments")))
    largest = tuple(as_tuple(item) for item in as_list(data.get("largest_kept", []), "plan.largest_kept"))
    timeline = data.get("timeline")
    if timeline is not None:
        timeline = _record(MemoryTimeline, timeline, "plan.timeline")
    planned = values.get("planned_inputs") or {}
    values["planned_inputs"] = {k: as_tuple(v) for k, v in planned.items()} if isinstance(planned, dict) else planned
    values["capture_notes"] = as_tuple(values.get("capture_notes", []))
    bound, recompute = values.get("recompute_bound_ms"), values.get("recompute_ms", 0)
    if bound == 0 and isinstance(recompute, (int, float)) and recompute > 0:  # older files: 0 = unproven
        values["recompute_bound_ms"] = None
    return Plan(module=None, segments=segments, largest_kept=largest, timeline=timeline, **values)


def _record(cls, raw: Any, where: str) -> Any:
    """``cls`` from a JSON object: its known keys, lists as tuples (the types are checked afterwards)."""
    if not isinstance(raw, dict):
        raise TypeError(f"{where} is {type(raw).__name__}, expected an object")
    known = {f.name for f in fields(cls)}
    return cls(**{k: as_tuple(v) for k, v in raw.items() if k in known})


def html_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """An HTML table of escaped text cells (the notebook summaries of plans and trade-offs)."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
