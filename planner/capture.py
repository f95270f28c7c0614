"""Turns an nn.Module into a torch.fx graph, recording which module call each node belongs to.

Capture is the only stage that looks at the user's Python code. It records, per
node, the stack of module calls around it (``node.meta["ckplan_scope"]``), which
later stages use to align segments to module boundaries and to rewrite the model
while keeping its module tree.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch
import torch.fx as fx
from torch import nn

from planner.errors import CaptureError, user_frame

SCOPE_KEY = "ckplan_scope"
"""``node.meta`` key: tuple of ``"path#call_index"`` strings, outermost first."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Inputs:
    """Example inputs of ``model(...)``, split into positional and keyword arguments."""

    args: tuple
    kwargs: dict[str, Any]

    def describe(self) -> tuple[str, ...]:
        """``name: dtype[shape]`` of each tensor input, for profiles and errors."""
        items = [(f"arg{i}", v) for i, v in enumerate(self.args)] + list(self.kwargs.items())
        return tuple(
            f"{name}: {str(v.dtype).removeprefix('torch.')}{list(v.shape)}" if isinstance(v, torch.Tensor)
            else f"{name}: {type(v).__name__}"
            for name, v in items
        )


def as_inputs(model: nn.Module, inputs: tuple | Mapping | torch.Tensor | None) -> Inputs:
    """Normalises ``inputs=`` (tuple, dict, single tensor, or the model's ``example_inputs``)."""
    if inputs is None:
        inputs = getattr(model, "example_inputs", None)
        if callable(inputs):
            inputs = inputs()
        if inputs is None:
            raise TypeError(
                f"no example inputs for {type(model).__name__}: pass inputs=(x,) or inputs={{'name': x}} "
                "to optimize(), or give the model an `example_inputs` attribute"
            )
    if isinstance(inputs, torch.Tensor):
        return Inputs(args=(inputs,), kwargs={})
    if isinstance(inputs, Mapping):
        return Inputs(args=(), kwargs=dict(inputs))
    if isinstance(inputs, (tuple, list)):
        return Inputs(args=tuple(inputs), kwargs={})
    raise TypeError(
        f"inputs must be a tuple of positional arguments or a dict of keyword arguments, "
        f"got {type(inputs).__name__}"
    )


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


class ScopeTracer(fx.Tracer):
    """``symbolic_trace`` that records the module calls around every node.

    Args:
        opaque: paths of user modules to keep as single ``call_module`` nodes
            instead of tracing through them (the rewriter's coarse trace).
    """

    def __init__(self, opaque: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.record_stack_traces = True
        self.opaque = opaque
        self._scope: list[str] = []
        self._calls: Counter[str] = Counter()

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self.opaque or super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m, forward, args, kwargs):
        path = self.path_of_module(m)
        self._scope.append(f"{path}#{self._calls[path]}")
        self._calls[path] += 1
        try:
            return super().call_module(m, forward, args, kwargs)
        finally:
            self._scope.pop()

    def create_node(self, *args, **kwargs) -> fx.Node:
        node = super().create_node(*args, **kwargs)
        node.meta[SCOPE_KEY] = tuple(self._scope)
        return node


def shallow_clone(module: nn.Module) -> nn.Module:
    """A new root object sharing every parameter, buffer, submodule and attribute of ``module``.

    Its own containers (parameter/buffer/submodule dicts, hook dicts) are copies, so
    attributes torch.fx adds while tracing (tensor constants), hooks registered on the
    clone, or a class change never reach the user's module.
    """
    clone = type(module).__new__(type(module))
    for key, value in module.__dict__.items():
        clone.__dict__[key] = value.copy() if isinstance(value, (dict, set)) else value
    return clone


@contextmanager
def training_mode(model: nn.Module) -> Iterator[None]:
    """Puts every module of ``model`` in training mode, restoring each one's flag afterwards."""
    flags = [(m, m.training) for m in model.modules()]
    model.train()
    try:
        yield
    finally:
        for m, flag in flags:
            m.training = flag


def trace(model: nn.Module, *, opaque: frozenset[str] = frozenset()) -> tuple[fx.GraphModule, nn.Module]:
    """Symbolically traces a shallow clone of ``model`` in training mode.

    Returns the GraphModule and the clone it was traced from (which holds any
    tensor constants the trace created); ``model`` itself is left untouched.

    Raises:
        CaptureError: naming the line of the model's code that could not be traced.
    """
    root = shallow_clone(model)
    try:
        with training_mode(root):
            graph = ScopeTracer(opaque).trace(root)
    except Exception as exc:  # noqa: BLE001 - any tracing failure becomes one clear error
        where = user_frame(exc)
        raise CaptureError(
            f"torch.fx could not trace {type(model).__name__}: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}"
            + (f" (at {where})" if where else "")
            + "; make that line traceable (no Python control flow on tensor values) or mark the "
            "submodule as a leaf"
        ) from exc
    return fx.GraphModule(root, graph, class_name=type(model).__name__), root


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
    from planner.capture_export import export_graph  # torch.export is only needed here

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


def call_module_path(scope: tuple[str, ...]) -> str:
    """Module path of the innermost call in a scope (``""`` for the root)."""
    return scope[-1].rsplit("#", 1)[0] if scope else ""


