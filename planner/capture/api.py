"""Turns an nn.Module into a graph, recording which module call each node belongs to.

Capture is the only stage that looks at the user's Python code. It records, per
node, the stack of module calls around it (``planner.capture.calls``), which
later stages use to align segments to module boundaries and to rewrite the model
while keeping its module tree. ``capture`` tries the tiers in order.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch.fx as fx
from torch import nn

from planner.capture.aten import aten_graph
from planner.capture.cache import no_cache
from planner.capture.calls import SCOPE_KEY, CallIndex, repeated_blocks
from planner.capture.fx import trace
from planner.capture.inputs import Inputs
from planner.capture.method import CaptureMethod
from planner.errors import CaptureError, InputError, user_frame


@dataclass(frozen=True, kw_only=True, slots=True)
class Captured:
    """A traced model: its graph and how the graph was obtained."""

    graph_module: fx.GraphModule
    """Graph of the model's forward; shares parameters and submodules with the model."""
    method: CaptureMethod
    """Which tier produced the graph."""
    fingerprint: str
    """Hash of the graph's structure: equal for two instances of one architecture."""
    notes: tuple[str, ...] = ()
    """One line per capture method that was tried first and failed, and why."""
    opaque: frozenset[str] = frozenset()
    """Modules kept as single calls because their code cannot be traced (never inlined)."""
    calls: CallIndex = field(init=False, repr=False, compare=False)
    """The module calls of the graph's nodes (placeholders and output excluded), built once here."""

    def __post_init__(self) -> None:
        nodes = [n for n in self.graph_module.graph.nodes if n.op not in ("placeholder", "output")]
        object.__setattr__(self, "calls", CallIndex.from_scopes([n.meta.get(SCOPE_KEY, ()) for n in nodes]))


FX, ATEN, EXPORT = CaptureMethod.FX, CaptureMethod.ATEN, CaptureMethod.EXPORT
FX_BLOCKS, FX_UNITS = CaptureMethod.FX_BLOCKS, CaptureMethod.FX_UNITS
"""Short names of the tiers (``CaptureMethod`` members)."""


def capture(model: nn.Module, inputs: Inputs | None = None, *, units: frozenset[str] = frozenset(),
            modules: bool = False) -> Captured:
    """Traces ``model`` into a flat graph, trying the tiers in order:

    1. ``torch.fx.symbolic_trace`` (user modules inlined, torch.nn layers kept as calls); the plan
       runs a rewritten graph. Skipped with ``modules=True``.
    2. With example inputs: the ATen ops of one real forward (``aten.aten_graph``; ``torch.export``
       for a model on the meta device), ``use_cache`` off as in training (``cache.no_cache``). The
       plan runs the model's own forward with module hooks.
    3. fx with the model's repeated blocks (then its children) kept as opaque calls.

    ``units`` (FSDP units): FSDP2 gathers a unit's parameters in hooks of its forward, which must run. fx
    keeps them as calls; when it cannot trace the model, tier 2 follows (the plan runs the model's own
    forward, units included).

    Raises:
        CaptureError: no tier could capture the model; names each failure.
        InputError: ``modules=True`` without example inputs.
    """
    notes: list[str] = []
    if units:  # FSDP units as calls, so that FSDP2's hooks run; else the model's own forward runs them
        try:
            gm, _ = trace(model, opaque=units)
            return Captured(graph_module=gm, method=FX_UNITS, fingerprint=fingerprint(gm.graph), opaque=units)
        except CaptureError as fx_error:
            if inputs is None:
                raise
            notes.append(f"{FX_UNITS.label} failed: {fx_error}")
            modules = True  # fx fails with the units as calls: it would with them inlined too
    if modules and inputs is None:
        raise InputError("planning the model's own forward (enable(), modules=True) needs example inputs: "
                         "pass inputs=<one training batch>")
    if not modules:
        try:
            gm, _ = trace(model)
            return Captured(graph_module=gm, method=FX, fingerprint=fingerprint(gm.graph))
        except CaptureError as fx_error:
            if inputs is None:
                raise
            notes.append(f"{FX.label} failed: {fx_error}")
    assert inputs is not None  # without inputs, modules=True raised above and a failed fx trace re-raised
    tier = EXPORT if any(t.is_meta for t in (*model.parameters(), *model.buffers())) else ATEN
    try:
        with no_cache(model):
            if tier is ATEN:
                gm = aten_graph(model, inputs.args, inputs.kwargs)
            else:
                from planner.capture.export import export_graph  # torch.export is only needed here

                gm = export_graph(model, inputs.args, inputs.kwargs)
        return Captured(graph_module=gm, method=tier, fingerprint=fingerprint(gm.graph), notes=tuple(notes))
    except Exception as exc:
        where = user_frame(exc)
        notes.append(f"{tier.label} failed: {type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
                     + (f" (at {where})" if where else ""))
    if not modules:
        for opaque in _opaque_candidates(model):  # module-level: the blocks' own code stays untraced
            try:
                gm, _ = trace(model, opaque=opaque)
            except CaptureError:
                continue
            return Captured(graph_module=gm, method=FX_BLOCKS, fingerprint=fingerprint(gm.graph),
                            notes=tuple(notes), opaque=opaque)
    raise CaptureError(
        "; and ".join(note.split("; make that line")[0] for note in notes)
        + ("" if modules else "; and tracing with its blocks as opaque calls failed too")
        + ": make the model's forward run on these inputs (and, for torch.fx, traceable: no Python control "
        "flow on tensor values)")


def _opaque_candidates(model: nn.Module) -> list[frozenset[str]]:
    """Module sets to keep opaque, finest first: the model's repeated blocks (``scope.repeated_blocks``:
    ``layers.0``...), then every direct child of the root."""
    out = [frozenset(repeated_blocks(name for name, _ in model.named_modules())),
           frozenset(name for name, _ in model.named_children())]
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
    return f"{module}.{name}" if module and module != "builtins" and not module.startswith("_operator") else str(name)


