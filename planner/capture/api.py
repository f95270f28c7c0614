"""Turns an nn.Module into a graph, recording which module call each node belongs to.

Capture is the only stage that looks at the user's Python code. It records, per
node, the stack of module calls around it (``planner.capture.calls``), which
later stages use to align segments to module boundaries and to rewrite the model
while keeping its module tree. ``capture`` tries the tiers in order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch.fx as fx
from torch import nn

from planner.capture.aten import aten_graph
from planner.capture.cache import no_cache
from planner.capture.calls import SCOPE_KEY, CallIndex, repeated_blocks
from planner.capture.fx import trace
from planner.capture.inputs import Inputs
from planner.capture.masks import eager_masks
from planner.capture.method import CaptureMethod, ExecutorKind
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


@dataclass(frozen=True, kw_only=True, slots=True)
class Request:
    """What one ``capture`` call asks for."""

    model: nn.Module
    inputs: Inputs | None
    """Example inputs; the tiers that run the model's forward need them."""
    units: frozenset[str]
    """FSDP units to keep as calls (their hooks gather parameters), or none."""
    whole_units: bool
    """Under FSDP, the plan keeps no op outputs (``selective=False``): a graph with the units as calls, which
    ``torch.compile`` compiles, loses nothing."""
    on_meta: bool
    """The model's parameters or buffers are on the meta device: no real forward can run."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Tier:
    """One way of capturing a model: when it applies, and how it makes the graph."""

    method: CaptureMethod
    """What it is called in the plan; ``method.executor`` says how its plans run."""
    applies: Callable[[Request], bool]
    run: Callable[[Request], tuple[fx.GraphModule, frozenset[str]]]
    """The graph and the modules it keeps as opaque calls; raises when the model does not capture this way."""


def _fx(request: Request) -> tuple[fx.GraphModule, frozenset[str]]:
    return trace(request.model)[0], frozenset()


def _fx_units(request: Request) -> tuple[fx.GraphModule, frozenset[str]]:
    return trace(request.model, opaque=request.units)[0], request.units


def _aten(request: Request) -> tuple[fx.GraphModule, frozenset[str]]:
    assert request.inputs is not None  # the tier applies with inputs only
    with no_cache(request.model):  # use_cache off, as in training
        return aten_graph(request.model, request.inputs.args, request.inputs.kwargs), frozenset()


def _export(request: Request) -> tuple[fx.GraphModule, frozenset[str]]:
    from planner.capture.export import export_graph  # torch.export is only needed here

    assert request.inputs is not None  # the tier applies with inputs only
    with no_cache(request.model), eager_masks(request.inputs.kwargs):  # the masks eager code makes, not export's
        return export_graph(request.model, request.inputs.args, request.inputs.kwargs), frozenset()


def _fx_blocks(request: Request) -> tuple[fx.GraphModule, frozenset[str]]:
    for opaque in _opaque_candidates(request.model):  # module-level: the blocks' own code stays untraced
        try:
            return trace(request.model, opaque=opaque)[0], opaque
        except CaptureError:
            continue
    raise CaptureError("neither the repeated blocks nor the root's children kept as calls trace")


TIERS = (
    Tier(method=FX, applies=lambda r: not r.units, run=_fx),
    Tier(method=FX_UNITS, applies=lambda r: bool(r.units) and r.whole_units, run=_fx_units),
    Tier(method=ATEN, applies=lambda r: r.inputs is not None and not r.on_meta, run=_aten),
    Tier(method=EXPORT, applies=lambda r: r.inputs is not None and r.on_meta, run=_export),
    Tier(method=FX_UNITS, applies=lambda r: bool(r.units) and not r.whole_units, run=_fx_units),
    Tier(method=FX_BLOCKS, applies=lambda r: not r.units, run=_fx_blocks),
)
"""The capture tiers, in the order they are tried (docs/architecture.md, "Capture, in order"):

1. torch.fx: user modules inlined, torch.nn layers kept as calls. Plans rewrite the graph. Not under FSDP:
   FSDP2 gathers a unit's parameters in hooks of its forward, which a rewritten graph would inline away.
   Under FSDP with whole units (``selective=False``): fx with the units kept as calls (compilable plans).
2. With example inputs: the ATen ops of one real forward (``aten.aten_graph``; ``torch.export`` for a model
   on the meta device), ``use_cache`` off as in training. Plans run the model's own forward with module
   hooks, so FSDP2's hooks run, segments can lie inside a unit and keep any op.
3. Under FSDP when that fails, or without example inputs (a saved plan applied): fx with the units as calls.
4. fx with the model's repeated blocks (then its children) kept as opaque calls. Plans rewrite the graph."""


def capture(model: nn.Module, inputs: Inputs | None = None, *, units: frozenset[str] = frozenset(),
            whole_units: bool = False, runs: ExecutorKind | None = None) -> Captured:
    """Captures ``model`` into a flat graph with the first of ``TIERS`` that applies and succeeds.

    Args:
        inputs: example inputs (the tiers that run the forward need them).
        units: FSDP units to keep as calls.
        whole_units: under FSDP, the plan keeps no op outputs: the units as calls come first.
        runs: only the tiers whose plans run this way (``ExecutorKind.HOOKS``: the model's own forward, for a
            plan made in place or one that follows the batch); None: any.

    Raises:
        CaptureError: no tier could capture the model; names each failure.
        InputError: ``runs=HOOKS`` without example inputs.
    """
    if runs is ExecutorKind.HOOKS and inputs is None:
        raise InputError("planning the model's own forward (enable(), follow_batch) needs example inputs: "
                         "pass inputs=<one training batch>")
    request = Request(model=model, inputs=inputs, units=units, whole_units=whole_units,
                      on_meta=any(t.is_meta for t in (*model.parameters(), *model.buffers())))
    notes: list[str] = []
    for tier in TIERS:
        if not tier.applies(request) or (runs is not None and tier.method.executor is not runs):
            continue
        try:
            gm, opaque = tier.run(request)
        except Exception as exc:
            notes.append(_failure(tier.method, exc))
            continue
        return Captured(graph_module=gm, method=tier.method, fingerprint=fingerprint(gm.graph), notes=tuple(notes),
                        opaque=opaque)
    fix = ("make the model's forward run on these inputs (and, for torch.fx, traceable: no Python control flow on "
           "tensor values)" if inputs is not None else "pass inputs=<one training batch>, so that ckplan can record "
           "one real forward, or make the model traceable (no Python control flow on tensor values)")
    raise CaptureError("; and ".join(note.split("; make that line")[0] for note in notes) + f": {fix}")


def _failure(method: CaptureMethod, exc: Exception) -> str:
    """One line saying why a tier failed: its own message, or the error's first line and the line of the user's
    code that raised it."""
    if isinstance(exc, CaptureError):
        return f"{method.label} failed: {exc}"
    where = user_frame(exc)
    return (f"{method.label} failed: {type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
            + (f" (at {where})" if where else ""))


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


