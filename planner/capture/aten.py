"""Capture tier 2: the ATen ops one real forward of the model runs, with the module call of each.

For models ``torch.fx.symbolic_trace`` cannot trace (Hugging Face models: transformers 5 dropped its
fx tracer; code with control flow on values). ``make_fx`` in real mode runs the model's own forward
on the example inputs and records every ATen op it dispatches above autograd (``pre_dispatch``),
with ``nn_module_stack``: the graph is what eager execution does, not what a tracer would see. That
matters: Hugging Face code takes other paths when it detects tracing (``torch.export`` materialises
causal masks and repeats grouped key/value heads that eager SDPA never copies), and the plan of such
a model runs eagerly (``planner.rewrite.chains``). The graph is specialised to the example inputs;
it is only profiled, never run by the planned module.

The forward runs as a training forward (gradients on), but autograd saves nothing for the backward that
never comes: no activation outlives its last use, so a model whose training step does not fit can still
be captured.

Each module call's tensor arguments are held by a checkpoint around it until its backward, used or
not (a Hugging Face decoder layer receives ``position_ids`` it never reads). So that the memory model
sees that, the call's first node is preceded by a ``keep_args`` node of the call's scope that reads
them: a no-op whose only effect is to mark those values as read inside the call.

Where the forward reads a tensor's value (``bool(mask.all())`` choosing a path, an ``.item()``), the graph
has the read (``aten.item``) and the graph module's ``meta[SCALAR_READS_KEY]`` has the values it read, in
order: a replay on meta tensors, which have no values, answers them from there (``profiling.meta``).

A custom ``torch.autograd.Function`` of the model's own code or a library's (TRL's chunked LM-head loss,
bitsandbytes' 4-bit matmul) is one node that calls the Function (``function_node``), not the ATen ops of its
forward: those run under no grad inside it, saving only what its ``ctx.save_for_backward`` keeps, and its own
backward runs, so the profile must run the Function itself. Inlined, a replay would run them with gradients on
(TRL's ``mm(out=...)`` then fails) and count every chunk of its logits as kept for a backward that never comes.
torch's own Functions (DTensor's, FSDP2's, reentrant checkpoint's) stay inlined, as tested.

Models on the meta device cannot run for real: they go through ``torch.export`` (``export.py``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from planner.capture.calls import SCOPE_KEY, entry, entry_path
from planner.capture.step import untouched
from planner.compat.torch_private import (
    OpOverload,
    disable_current_modes,
    disable_torch_function,
    function_apply_replaced,
    last_node,
    make_fx_real,
    set_pytree_calling,
    traced_node,
    traced_proxies,
    tracing_graph,
    track_outputs,
    tree_flatten,
    tree_unflatten,
)

SCALAR_READS_KEY = "ckplan_scalar_reads"
"""``GraphModule.meta`` key: the values the forward's reads of tensor values returned, in graph order."""

SCALAR_READS = (torch.ops.aten.item.default, torch.ops.aten._local_scalar_dense.default,
                torch.ops.aten.is_nonzero.default)
"""The ATen ops that read a tensor's value into Python (``bool(t)``, ``t.item()``)."""


def _drop(tensor: torch.Tensor) -> None:
    """What autograd keeps of a saved tensor during capture: nothing."""


def _never(kept: None) -> torch.Tensor:
    raise AssertionError("no backward runs on the capture's forward")


def keep_args(*tensors: torch.Tensor) -> None:
    """The graph's stand-in for a module call holding its tensor arguments (see the module docstring)."""


def aten_graph(model: nn.Module, args: tuple, kwargs: dict) -> fx.GraphModule:
    """The ATen graph of one training-mode forward of ``model`` on these inputs, taking the same
    arguments and returning the same output structure as the model. The forward runs for real, so
    ``model``'s buffers (BatchNorm statistics) and the RNG state are put back after it.

    Raises whatever the model's forward raises; the caller reports it.
    """
    leaves, in_spec = tree_flatten((args, kwargs))
    out_specs = []

    def flat_forward(*flat):
        call_args, call_kwargs = tree_unflatten(list(flat), in_spec)
        out, out_spec = tree_flatten(model(*call_args, **call_kwargs))
        out_specs.append(out_spec)
        return out

    flat_forward.__dict__["_orig_mod"] = model  # make_fx records module scopes relative to this root
    calls: list[tuple[str, fx.Node, list[fx.Node]]] = []
    hooks = [module.register_forward_pre_hook(functools.partial(_note_call, calls, path), with_kwargs=True)
             for path, module in model.named_modules() if path]
    try:
        # training mode; BatchNorm statistics, gradients and the RNG put back after. Autograd saves nothing:
        # it would keep every activation of the forward alive until the graph is made, and a model whose
        # step does not fit would not be captured (no backward ever runs on this forward)
        with untouched(model), torch.autograd.graph.saved_tensors_hooks(_drop, _never), functions_as_nodes():
            gm = make_fx_real(flat_forward, pre_dispatch=True, record_module_stack=True)(*leaves)
    finally:
        for hook in hooks:
            hook.remove()
    _note_scalar_reads(gm, model, leaves)
    names = [f"arg{i}" for i in range(len(args))] + list(kwargs)  # the call's own argument names
    set_pytree_calling(gm, names, in_spec, out_specs[-1])
    gm.recompile()
    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack") or {}
        node.meta[SCOPE_KEY] = tuple(entry(path, key) for key, (path, _) in stack.items() if path)
    _add_keep_nodes(gm.graph, calls)
    gm.recompile()
    return gm


@functools.cache
def function_node(cls: type[torch.autograd.Function]) -> Any:
    """The graph's call of the custom ``torch.autograd.Function`` ``cls`` (one target per class, named after it)."""
    def apply(*args: Any) -> Any:
        return cls.apply(*args)

    apply.__name__ = apply.__qualname__ = f"apply_{cls.__name__}"
    return apply


@contextlib.contextmanager
def functions_as_nodes() -> Iterator[None]:
    """While ``make_fx`` traces: each custom ``autograd.Function`` outside torch runs untraced, for real, and
    is recorded as one ``function_node`` call with its tensor arguments and constants."""

    def apply(cls: type[torch.autograd.Function], original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        tracing = tracing_graph()
        if tracing is None or kwargs or cls.__module__.split(".")[0] == "torch":
            return original(cls, *args, **kwargs)
        tracer, graph = tracing
        with disable_current_modes(), disable_torch_function():
            out = original(cls, *args)
        proxy = tracer.create_proxy("call_function", function_node(cls), tuple(traced_proxies(args, tracer)), {})
        track_outputs(out, proxy, tracer)
        stray = proxy.node.next
        while stray.op != "root":  # the nodes tracking the outputs added: drop the tracker's own allocations
            following = stray.next
            if not stray.users and isinstance(stray.target, OpOverload):
                graph.erase_node(stray)
            stray = following
        return out

    with function_apply_replaced(apply):
        yield


class _ReadsOnly(fx.Interpreter):
    """Runs only the nodes in ``needed`` (what the graph's value reads depend on); the others are None."""

    def __init__(self, gm: fx.GraphModule, needed: set[fx.Node]) -> None:
        super().__init__(gm)
        self.needed = needed
        self.values: dict[fx.Node, object] = {}

    def run_node(self, n: fx.Node) -> object:
        if n.op != "placeholder" and n not in self.needed:
            return None
        value = self.values[n] = super().run_node(n)
        return value


def _note_scalar_reads(gm: fx.GraphModule, model: nn.Module, leaves: list) -> None:
    """Records in ``gm.meta`` the values the graph's value reads return on these inputs (``SCALAR_READS_KEY``):
    make_fx keeps the read but not its value. Only the nodes the reads depend on run (a mask's reductions,
    usually), without gradients, the model's buffers and the RNG put back after."""
    reads = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in SCALAR_READS]
    if not reads:
        return
    needed: set[fx.Node] = set()
    stack = list(reads)
    while stack:
        node = stack.pop()
        if node not in needed:
            needed.add(node)
            stack.extend(node.all_input_nodes)
    runner = _ReadsOnly(gm, needed)
    with untouched(model), torch.no_grad():
        runner.run(*leaves)
    gm.meta[SCALAR_READS_KEY] = [runner.values[n] for n in reads]


def _note_call(calls: list, path: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Pre-hook while tracing: the call's path, the graph's last node before it, its tensor arguments."""
    tracing = tracing_graph()
    if tracing is None:
        return
    tracer, graph = tracing
    found = [node for leaf in tree_flatten((args, kwargs))[0] if isinstance(leaf, torch.Tensor)
             for node in [traced_node(leaf, tracer)] if node is not None]
    if found:
        calls.append((path, last_node(graph), found))


def _add_keep_nodes(graph: fx.Graph, calls: list) -> None:
    """A ``keep_args`` node before each call's first node, in the call's scope."""
    for path, before, arguments in calls:
        first = before.next
        while first.op != "output" and not any(entry_path(e) == path for e in first.meta.get(SCOPE_KEY, ())):
            first = first.next
        if first.op == "output":
            continue  # the call ran no op
        scope = first.meta[SCOPE_KEY]
        depth = next(i for i, e in enumerate(scope) if entry_path(e) == path)
        arguments = list(dict.fromkeys(arguments))
        with graph.inserting_before(first):
            keep = graph.call_function(keep_args, tuple(arguments))
        keep.meta[SCOPE_KEY] = scope[:depth + 1]
        keep.meta["nn_module_stack"] = dict(list(first.meta.get("nn_module_stack", {}).items())[:depth + 1])
