"""Emits a module that runs a plan with ``torch.utils.checkpoint`` and keeps the user's module tree.

The planned module is a shallow clone of the user's root module (sharing every
parameter, buffer and submodule) whose class is a generated subclass. Its
``forward`` is the model re-traced with every submodule outside the segments
kept as a call (so its hooks run), and each segment becomes a method called
through ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` whose
body is the traced code of its ops (torch.nn layers still called as modules).
In eval mode or under ``torch.no_grad()`` the user's own forward runs unchanged.

A planned module pickles the way torch.fx's ``GraphModule`` does: ``pickle`` and ``torch.save`` store
its ``GeneratedClass`` (the user's class by reference, the source, the globals the source reads) in place
of the generated class, which no module holds, and loading compiles the class again from the source;
``copy.deepcopy`` keeps the class.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import inspect
import linecache
import operator
import textwrap
import types
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from planner.capture.api import Captured
from planner.capture.calls import CallIndex, is_inside
from planner.capture.fx import shallow_clone, trace
from planner.memory.excess import opened_paths
from planner.rewrite.sac import compiled_sac_contexts, sac_contexts, sac_mark, trace_marks_into_graphs

SEGMENT_PREFIX = "_ckplan_segment_"
CONTEXT_PREFIX = "_ckplan_context_"


def _recompute_all(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


COMPILED_CONTEXT = functools.partial(create_selective_checkpoint_contexts, _recompute_all)
"""``context_fn`` under torch.compile of a segment without saves: what a plain checkpoint gets there
(recompute all). Segments with saves get ``planner.rewrite.sac.compiled_sac_contexts``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SegmentSpec:
    """One checkpointed segment, in terms of the flat captured graph."""

    nodes: tuple[str, ...]
    """Names of its nodes in the flat graph, contiguous and in order."""
    restore_buffers: tuple[str, ...] = ()
    """Buffers its forward mutates (BatchNorm statistics): restored after recomputation."""
    saved_nodes: tuple[str, ...] = ()
    """Nodes whose outputs selective checkpointing keeps instead of re-running (``planner.rewrite.sac``)."""
    random: bool = True
    """Its forward draws random numbers: the checkpoint stashes the RNG state (``preserve_rng_state``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Rewritten:
    """The planned module and the Python source of its generated class."""

    module: nn.Module
    source: str


@contextlib.contextmanager
def restore_buffers(module: nn.Module, names: Sequence[str]) -> Iterator[None]:
    """Puts the named buffers back as they were on entry, so a recomputation updates
    BatchNorm statistics (or any buffer) no more than the original forward did."""
    saved = [(buf, buf.detach().clone()) for buf in (module.get_buffer(n) for n in names)]
    try:
        yield
    finally:
        with torch.no_grad():
            for buf, value in saved:
                buf.copy_(value)


def rewrite(model: nn.Module, captured: Captured, segments: Sequence[SegmentSpec]) -> Rewritten:
    """Builds the planned module for ``segments`` of ``model``'s captured graph.

    Args:
        model: the user's module (not modified).
        captured: what ``capture`` produced for ``model``.
        segments: what to checkpoint, in graph order, non-overlapping.
    """
    if not segments:
        return Rewritten(module=shallow_clone(model), source="# empty plan: the model's own forward runs\n")
    flat = [n for n in captured.graph_module.graph.nodes if n.op not in ("placeholder", "output")]
    position = {n.name: i for i, n in enumerate(flat)}
    ranges = []
    for seg in segments:
        lo, hi = position[seg.nodes[0]], position[seg.nodes[-1]] + 1
        if [n.name for n in flat[lo:hi]] != list(seg.nodes):
            raise ValueError(f"segment {seg.nodes[0]}..{seg.nodes[-1]} is not a contiguous run of the graph")
        ranges.append((lo, hi))
    opened = {path for path in opened_paths(captured.calls, ranges) if not is_inside(path, captured.opaque)}
    every = {name for name, _ in model.named_modules() if name}
    coarse_gm, root = trace(model, opaque=frozenset(every - opened))
    spans = _flat_spans(coarse_gm.graph, flat, captured.calls)
    groups = [[n for n, (lo, hi) in spans.items() if a <= lo and hi <= b] for a, b in ranges]
    for (a, b), group in zip(ranges, groups):
        covered = {i for n in group for i in range(*spans[n])}
        if any(i not in covered and flat[i].op != "get_attr" for i in range(a, b)):
            raise AssertionError(f"segment nodes {a}:{b} do not align with the re-traced graph")
    saved = [_saved_in(group, spans, flat, seg) for group, seg in zip(groups, segments)]
    main, pieces = _split(coarse_gm.graph, groups, [bool(s.restore_buffers or s.saved_nodes) for s in segments],
                          [s.random for s in segments], saved)
    name = f"Checkpointed{type(model).__name__}"
    source, code_globals = _generate(type(model), name, main, pieces, segments, guard=_eval_guard(type(model), main))
    root.__class__ = GeneratedClass.of(type(model), name, source, code_globals).new_class()
    return Rewritten(module=root, source=source)


def _saved_in(group: list[fx.Node], spans: dict, flat: list[fx.Node], seg: SegmentSpec) -> set[fx.Node]:
    """The re-traced nodes of a segment that stand for its saved flat nodes (one each)."""
    found = {n for n in group if spans[n][1] - spans[n][0] == 1 and flat[spans[n][0]].name in seg.saved_nodes}
    if len(found) != len(seg.saved_nodes):
        names = {flat[spans[n][0]].name for n in found}
        raise AssertionError(f"saved nodes {sorted(set(seg.saved_nodes) - names)} are not single nodes of "
                             "the re-traced segment")
    return found


def _flat_spans(coarse: fx.Graph, flat: list[fx.Node], calls: CallIndex) -> dict[fx.Node, tuple[int, int]]:
    """Range of flat nodes each coarse node stands for.

    ``get_attr`` nodes have no position to match: a trace reads each parameter once, where it is
    first used, so a parameter two modules hold (weight tying) is read inside the first of them in
    the flat trace but inside the second when the coarse trace keeps the first as a call. They get
    no span; ``_split`` and ``_segment_graph`` copy them to wherever they are used, and a flat one
    outside every call's span belongs to no segment's coverage.
    """
    spans: dict[fx.Node, tuple[int, int]] = {}
    ptr = 0
    for node in coarse.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        while ptr < len(flat) and flat[ptr].op == "get_attr":
            ptr += 1
        if ptr >= len(flat):
            raise AssertionError(f"re-traced graph has more nodes than the captured one at {node.name}")
        if node.op == "call_module":
            call = next((c for c in calls.around[ptr] if calls.path(c) == node.target), None)
            if call is None:
                raise AssertionError(f"re-traced call of {node.target} does not match node {flat[ptr].name}")
            hi = ptr
            while hi < len(flat) and call in calls.around[hi]:
                hi += 1
        else:
            if flat[ptr].op != node.op or flat[ptr].target != node.target:
                raise AssertionError(f"re-traced node {node.format_node()} does not match {flat[ptr].format_node()}")
            hi = ptr + 1
        spans[node] = (ptr, hi)
        ptr = hi
    if any(n.op != "get_attr" for n in flat[ptr:]):
        raise AssertionError("re-traced graph covers fewer nodes than the captured one")
    return spans


def _split(graph: fx.Graph, groups: list[list[fx.Node]], with_context: list[bool], random: list[bool],
           saved: list[set[fx.Node]] | None = None) -> tuple[fx.Graph, list[fx.Graph]]:
    """Moves each group into its own graph; the main graph calls it through ``checkpoint``, which stashes the RNG
    state for groups whose ``random`` is True. ``saved[g]``: nodes of group g bracketed by ``sac_mark`` calls
    (selective checkpointing)."""
    group_of = {node: g for g, nodes in enumerate(groups) for node in nodes}
    main = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    pieces: list[fx.Graph] = []
    for node in graph.nodes:
        g = group_of.get(node)
        if g is None:
            env[node] = main.node_copy(node, lambda a: env[a])
            continue
        if node is not groups[g][-1]:  # emit at the last node: every external input exists by then
            continue
        members = set(groups[g])
        inputs = _external_inputs(groups[g], members)
        outputs = [n for n in groups[g] if any(u not in members for u in n.users)]
        pieces.append(_segment_graph(groups[g], inputs, outputs, saved[g] if saved else set()))
        kwargs: dict = {"use_reentrant": False}
        if not random[g]:  # nothing random to draw alike when re-run: no RNG state to stash
            kwargs["preserve_rng_state"] = False
        if with_context[g]:
            kwargs["context_fn"] = main.get_attr(f"{CONTEXT_PREFIX}{g}")
        fn = main.get_attr(f"{SEGMENT_PREFIX}{g}")
        call = main.call_function(checkpoint, (fn, *(env[i] for i in inputs)), kwargs)
        for k, out in enumerate(outputs):
            env[out] = main.create_node("call_function", operator.getitem, (call, k), name=out.name)
    for node in list(main.nodes):
        if node.op == "get_attr" and not node.users:
            main.erase_node(node)
    return main, pieces


def _external_inputs(nodes: list[fx.Node], members: set[fx.Node]) -> list[fx.Node]:
    seen: dict[fx.Node, None] = {}
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg not in members and arg.op != "get_attr":
                seen.setdefault(arg, None)
    return list(seen)


def _segment_graph(nodes: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node],
                   saved: frozenset[fx.Node] | set[fx.Node] = frozenset()) -> fx.Graph:
    graph = fx.Graph()
    env = {i: graph.placeholder(i.name) for i in inputs}

    def lookup(arg: fx.Node) -> fx.Node:
        if arg not in env:  # a parameter or constant read inside the segment
            env[arg] = graph.node_copy(arg)
        return env[arg]

    for node in nodes:
        if node in saved:
            for arg in node.all_input_nodes:  # parameters and constants read before the bracket opens
                lookup(arg)
            graph.call_function(sac_mark, (True,))
        env[node] = graph.node_copy(node, lookup)
        if node in saved:
            graph.call_function(sac_mark, (False,))
    graph.output(tuple(env[o] for o in outputs))
    return graph


def _generate(base: type, name: str, main: fx.Graph, pieces: list[fx.Graph],
              segments: Sequence[SegmentSpec], *, guard: str) -> tuple[str, dict]:
    """Python source of the planned class ``name`` and the globals its traced code reads, besides
    ``_runtime_globals``."""
    namespace = _runtime_globals(base)
    runtime = set(namespace)
    body = [_method(main, "forward", namespace, guard=guard)]
    for g, piece in enumerate(pieces):
        body.append(_method(piece, f"{SEGMENT_PREFIX}{g}", namespace))
        if segments[g].saved_nodes:
            body.append(
                f"@property\n"
                f"def {CONTEXT_PREFIX}{g}(self):\n"
                f"    # selective checkpointing: keep the outputs of {len(segments[g].saved_nodes)} node(s), "
                f"re-run the rest\n"
                f"    if torch.compiler.is_compiling():\n"
                f"        return _ckplan_compiled_sac_contexts\n"
                f"    return lambda: _ckplan_sac_contexts(self, {segments[g].restore_buffers!r}, "
                f"_ckplan_restore_buffers)\n"
            )
        elif segments[g].restore_buffers:
            body.append(
                f"@property\n"
                f"def {CONTEXT_PREFIX}{g}(self):\n"
                f"    # recomputing this segment must not update these buffers a second time; torch.compile\n"
                f"    # applies buffer updates once whatever it recomputes, and accepts plain functions only\n"
                f"    if torch.compiler.is_compiling():\n"
                f"        return _ckplan_compiled_context\n"
                f"    return lambda: (contextlib.nullcontext(),\n"
                f"                    _ckplan_restore_buffers(self, {segments[g].restore_buffers!r}))\n"
            )
    doc = (f'"""{name.removeprefix("Checkpointed")} running a ckplan activation-checkpointing plan '
           f'({len(pieces)} segment{"s" if len(pieces) != 1 else ""})."""\n')
    source = f"class {name}(_ckplan_base):\n" + textwrap.indent(doc + "\n" + "\n".join(body), "    ")
    return source, {key: value for key, value in namespace.items() if key not in runtime}


def _runtime_globals(base: type) -> dict[str, Any]:
    """The globals of every generated class besides its traced code's: its base, torch, and the
    checkpoint contexts its ``_ckplan_context_<g>`` properties return."""
    return {"_ckplan_base": base, "torch": torch, "contextlib": contextlib,
            "_ckplan_restore_buffers": restore_buffers, "_ckplan_compiled_context": COMPILED_CONTEXT,
            "_ckplan_sac_contexts": sac_contexts, "_ckplan_compiled_sac_contexts": compiled_sac_contexts}


def _method(graph: fx.Graph, name: str, namespace: dict, guard: str = "") -> str:
    code = graph.python_code(root_module="self")
    for key, value in code.globals.items():
        if key in namespace and namespace[key] is not value:
            raise AssertionError(f"generated code needs two different globals named {key}")
        namespace[key] = value
    lines = code.src.strip("\n").splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("def forward("))
    lines[head] = lines[head].replace("def forward(", f"def {name}(", 1)
    if guard:
        lines.insert(head + 1, guard)
    return "\n".join(ln.rstrip() for ln in lines[head:]) + "\n"


def _eval_guard(base: type[nn.Module], main: fx.Graph) -> str:
    """First lines of ``forward``: outside training, run the user's own forward."""
    names = [n.target.lstrip("*") for n in main.nodes if n.op == "placeholder"]  # as in the def line
    params = list(inspect.signature(base.forward).parameters.values())[1:]
    args = []
    for param, name in zip(params, names):
        if param.kind is inspect.Parameter.VAR_POSITIONAL:
            args.append(f"*{name}")
        elif param.kind is inspect.Parameter.VAR_KEYWORD:
            args.append(f"**{name}")
        elif param.kind is inspect.Parameter.KEYWORD_ONLY:
            args.append(f"{param.name}={name}")
        else:
            args.append(name)
    call = ", ".join(["self", *args])
    return ("    if not (self.training and torch.is_grad_enabled()):  # the plan only matters for training\n"
            f"        return _ckplan_base.forward({call})")


@dataclass(frozen=True, kw_only=True, slots=True)
class GeneratedClass:
    """Everything a planned module's class is compiled from, in a form pickle stores (no module objects):
    what ``pickle``, ``torch.save`` and ``copy.deepcopy`` keep of the class, to compile it again on load."""

    base: type[nn.Module]
    """The user's class, stored by reference: loading needs it importable, as for the unplanned model."""
    name: str
    """The generated class's name, ``Checkpointed<Base>``."""
    source: str
    """Python source of the class (``Plan.source``)."""
    objects: Mapping[str, Any]
    """Globals the traced code reads that pickle stores by reference (functions, classes, numbers)."""
    modules: Mapping[str, str]
    """Globals the traced code reads that are modules, by import name."""

    @classmethod
    def of(cls, base: type[nn.Module], name: str, source: str, code_globals: Mapping[str, Any]) -> GeneratedClass:
        """The class ``name`` of ``source`` on ``base``; ``code_globals``: what the traced code reads."""
        return cls(base=base, name=name, source=source,
                   objects={k: v for k, v in code_globals.items() if not isinstance(v, types.ModuleType)},
                   modules={k: v.__name__ for k, v in code_globals.items() if isinstance(v, types.ModuleType)})

    def new_class(self) -> type[nn.Module]:
        """A new class from the source, which pickles and deep-copies its instances as planned modules."""
        namespace = {**_runtime_globals(self.base), **self.objects,
                     **{key: importlib.import_module(module) for key, module in self.modules.items()}}
        if any(value is sac_mark for value in self.objects.values()):
            trace_marks_into_graphs()  # so that torch.compile(planned) applies the saves too
        filename = f"<ckplan generated {self.name}>"
        linecache.cache[filename] = (len(self.source), None, self.source.splitlines(True), filename)
        exec(compile(self.source, filename, "exec"), namespace)
        cls = namespace[self.name]
        cls.__module__ = self.base.__module__
        cls.__reduce_ex__ = functools.partialmethod(_reduce_planned, self)
        cls.__deepcopy__ = _deepcopy_planned
        return cls


def planned_instance(generated: GeneratedClass) -> nn.Module:
    """An empty planned module of a class compiled again from ``generated``: what unpickling calls
    (then it sets the module's state). Each load compiles its own class, as ``GraphModule`` does."""
    return object.__new__(generated.new_class())  # not the base's __new__ (GraphModule's makes its own class)


def _reduce_planned(self: nn.Module, generated: GeneratedClass, protocol: int) -> tuple:
    """``__reduce_ex__`` of the class ``generated`` compiles: ``generated`` in place of the class (which no
    module holds), then the module's state as the user's class pickles it."""
    return planned_instance, (generated,), self.__getstate__()


def _deepcopy_planned(self: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """``__deepcopy__`` of a generated class: what ``copy.deepcopy`` does to any module (a new object, a
    deep copy of the state), keeping the class instead of compiling it again as ``__reduce_ex__`` would."""
    copied = object.__new__(type(self))
    memo[id(self)] = copied
    copied.__setstate__(copy.deepcopy(self.__getstate__(), memo))
    return copied
