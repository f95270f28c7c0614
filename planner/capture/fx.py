"""Capture tier 1: ``torch.fx.symbolic_trace`` of a shallow clone, recording the module calls around
every node. Also the coarse re-trace the rewriter uses (modules kept as calls)."""

from __future__ import annotations

import dis
import inspect
import sys
from bisect import bisect_left
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.fx as fx
from torch import nn

from planner.capture.calls import SCOPE_KEY, entry
from planner.errors import CaptureError, user_frame


def unpacked(value: Any) -> tuple:
    """``a, b, c = value`` as Python runs it: a tensor is unbound along dim 0 by one op (``Tensor.__iter__``)."""
    return tuple(value)


class UnpackingProxy(fx.Proxy):
    """A Proxy whose ``a, b, c = proxy`` records what eager code runs: one ``unpacked`` call (``unbind``
    for a tensor), then items of its tuple. torch.fx's own Proxy records one ``select`` per item, whose
    backward allocates a zero tensor the size of the whole input for each item: the profile of that
    graph would not be the step the model's own forward runs (``q, k, v = qkv`` in attention)."""

    def __iter__(self) -> Iterator[fx.Proxy]:
        here = inspect.currentframe()
        frame = here.f_back if here is not None else None
        assert frame is not None  # CPython has frames, and this method is always called from one
        instructions = list(dis.get_instructions(frame.f_code))
        at = (bisect_left(instructions, frame.f_lasti, key=lambda i: i.offset) if sys.version_info >= (3, 11)
              else frame.f_lasti // 2)  # as torch.fx.Proxy.__iter__ finds the calling instruction
        inst = instructions[at]
        if inst.opname == "UNPACK_SEQUENCE":
            items = self.tracer.create_proxy("call_function", unpacked, (self,), {})
            return (items[i] for i in range(inst.argval))  # type: ignore[index]  # fx.Proxy gets [] at runtime
        return self.tracer.iter(self)


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
        self._scope.append(entry(path, self._calls[path]))
        self._calls[path] += 1
        try:
            return super().call_module(m, forward, args, kwargs)
        finally:
            self._scope.pop()

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return UnpackingProxy(node, self)

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
    except Exception as exc:
        where = user_frame(exc)
        raise CaptureError(
            f"torch.fx could not trace {type(model).__name__}: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}"
            + (f" (at {where})" if where else "")
            + "; make that line traceable (no Python control flow on tensor values) or mark the "
            "submodule as a leaf"
        ) from exc
    return fx.GraphModule(root, graph, class_name=type(model).__name__), root
