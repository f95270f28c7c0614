"""Turns an nn.Module into a graph, recording which module call each node belongs to.

Capture is the only stage that looks at the user's Python code. It records, per
node, the stack of module calls around it (``planner.capture.scope``), which
later stages use to align segments to module boundaries and to rewrite the model
while keeping its module tree. ``capture`` tries the tiers in order.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch.fx as fx
from torch import nn

from planner.capture.fx import trace
from planner.capture.inputs import Inputs
from planner.errors import CaptureError, user_frame


@dataclass(frozen=True, kw_only=True, slots=True)
class Captured:
    """A traced model: its graph and how the graph was obtained."""

    graph_module: fx.GraphModule
    """Graph of the model's forward; shares parameters and submodules with the model."""
    method: str
    """How the graph was obtained: ``FX`` or ``EXPORT``."""
    fingerprint: str
    """Hash of the graph's structure: equal for two instances of one architecture."""
    notes: tuple[str, ...] = ()
    """One line per capture method that was tried first and failed, and why."""
    opaque: frozenset[str] = frozenset()
    """Modules kept as single calls because their code cannot be traced (never inlined)."""


FX = "torch.fx.symbolic_trace"
EXPORT = "torch.export (non-strict)"
FX_BLOCKS = "torch.fx.symbolic_trace (blocks as opaque calls)"
FX_UNITS = "torch.fx.symbolic_trace (FSDP units as calls)"


def capture(model: nn.Module, inputs: Inputs | None = None, *, units: frozenset[str] = frozenset()) -> Captured:
    """Traces ``model`` into a flat graph, with ``torch.fx.symbolic_trace`` (user modules inlined,
    torch.nn layers kept as calls) or, when that fails and example inputs are given, with
    ``torch.export`` on those inputs. ``units`` (FSDP units) are kept as calls, fx only: FSDP2
    gathers a unit's parameters in hooks of its forward, which must run.

    Raises:
        CaptureError: no method could capture the model; names each failure.
    """
    if units:
        gm, _ = trace(model, opaque=units)
        return Captured(graph_module=gm, method=FX_UNITS, fingerprint=fingerprint(gm.graph), opaque=units)
    try:
        gm, _ = trace(model)
        return Captured(graph_module=gm, method=FX, fingerprint=fingerprint(gm.graph))
    except CaptureError as fx_error:
        if inputs is None:
            raise
        note = f"{FX} failed: {fx_error}"
    from planner.capture.export import export_graph  # torch.export is only needed here

    try:
        gm = export_graph(model, inputs.args, inputs.kwargs)
        return Captured(graph_module=gm, method=EXPORT, fingerprint=fingerprint(gm.graph), notes=(note,))
    except Exception as exc:  # noqa: BLE001 - report every failure in one error
        where = user_frame(exc)
        export_note = (f"{EXPORT} failed: {type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
                       + (f" (at {where})" if where else ""))
    for opaque in _opaque_candidates(model):  # module-level: the blocks' own code stays untraced
        try:
            gm, _ = trace(model, opaque=opaque)
        except CaptureError:
            continue
        return Captured(graph_module=gm, method=FX_BLOCKS, fingerprint=fingerprint(gm.graph),
                        notes=(note, export_note), opaque=opaque)
    raise CaptureError(
        f"{note.split('; make that line')[0]}; and {export_note}; and tracing with its blocks as opaque "
        "calls failed too: make the model's forward traceable on these inputs (no Python control flow on "
        "tensor values)")


def _opaque_candidates(model: nn.Module) -> list[frozenset[str]]:
    """Module sets to keep opaque, finest first: the children of the largest container of numbered
    submodules (``layers.0``...), then every direct child of the root."""
    children: dict[str, list[str]] = {}
    for name, _ in model.named_modules():
        parent, _, last = name.rpartition(".")
        if last.isdigit():
            children.setdefault(parent, []).append(name)
    out = []
    if children:
        out.append(frozenset(max(children.values(), key=len)))
    out.append(frozenset(name for name, _ in model.named_children()))
    return [c for c in out if c]


def fingerprint(graph: fx.Graph) -> str:
    """Structure hash of a graph: node kinds, targets and connections, not values."""
    digest = hashlib.sha256()
    for node in graph.nodes:
        target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", repr(node.target))
        args = fx.node.map_arg((node.args, node.kwargs), lambda n: f"%{n.name}")
        digest.update(f"{node.name}|{node.op}|{target}|{args}\n".encode())
    return digest.hexdigest()[:16]


def target_text(node: fx.Node) -> str:
    """Readable name of what a node calls."""
    if isinstance(node.target, str):
        return node.target
    module = getattr(node.target, "__module__", None) or ""
    name = getattr(node.target, "__qualname__", None) or getattr(node.target, "__name__", repr(node.target))
    return f"{module}.{name}" if module and module != "builtins" and not module.startswith("_operator") else name


