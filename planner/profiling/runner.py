"""Runs one training step of a captured graph node by node, with hooks around every node.

The machinery both profiling passes share (``planner.profile``'s memory pass and
``planner.profiling.timing``'s timed pass): an ``fx.Interpreter`` that computes the loss,
runs backward, attributes every autograd node to the graph node that created it, and
turns a failing node into one error naming it, the user's line and the input shapes.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from planner.capture.inputs import Inputs
from planner.capture.step import LossFn, backward, sync
from planner.compat.torch_private import flatten_with_spec, pytree_specs, storage_id, tree_leaves
from planner.errors import ProfileError, in_library, user_frame


def _node_error(node_text: str, where: str | None, exc: Exception, values: list[Any], fix: str) -> ProfileError:
    shapes = ", ".join(
        f"{str(v.dtype).removeprefix('torch.')}{list(v.shape)}" for v in values if isinstance(v, torch.Tensor)
    )
    return ProfileError(
        f"{node_text} failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        + (f" (at {where})" if where else "")
        + (f"; its tensor inputs are {shapes}" if shapes else "") + f"; {fix}"
    )


def _stack_line(node: fx.Node) -> str | None:
    """``file:line: code`` of the user's code that created ``node``: the innermost frame of the node's stack
    trace outside torch and ckplan (the tracer's own frames end it), else its outermost (the forward of a
    torch.nn layer traced as the model)."""
    frames = re.findall(r'File "([^"]*)", line (\d+), in [^\n]*\n[ \t]*([^\n]*)', node.stack_trace or "")
    mine = [f for f in frames if not in_library(f[0])]
    if not frames:
        return None
    path, line, code = mine[-1] if mine else frames[0]
    return f"{path}:{line}: {code.strip()}"


SEEN_KEY = "ckplan.step"
"""Key in an autograd node's ``metadata`` marking it as hooked in the step whose token it holds."""


def _new_autograd_nodes(result: Any, step: object) -> list:
    """Autograd nodes reachable from ``result`` that no earlier graph node of ``step`` created. The mark
    lives on the node (``Node.metadata``): a set of nodes here would keep alive those of a branch off
    the loss's path (``if h.abs().sum() > 0``), and with them the tensors they saved."""
    stack = [t.grad_fn for t in tree_leaves(result) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    found = []
    while stack:
        fn = stack.pop()
        metadata: dict = fn.metadata  # type: ignore[assignment]  # a dict on C++ nodes; torch types a method
        if metadata.get(SEEN_KEY) is step:
            continue
        metadata[SEEN_KEY] = step
        found.append(fn)
        stack.extend(nxt for nxt, _ in fn.next_functions
                     if nxt is not None and type(nxt).__name__ != "AccumulateGrad")
    return found


class StepRunner(fx.Interpreter):
    """Runs graph + loss + backward, calling ``around_node`` for each node's forward
    and ``on_backward(index, phase)`` around each node's autograd nodes."""

    follows_loss = False
    """Whether ``on_loss_gradients`` is called (the memory recorder's; the timed runs leave the hooks bare)."""

    def __init__(self, gm: fx.GraphModule, device: torch.device, *, keep_output: bool = True) -> None:
        super().__init__(gm)
        self.extra_traceback = False  # a failing node's ProfileError names it and the user's line in one line
        self.device = device
        self.keep_output = keep_output
        """Whether the step's output stays referenced through backward (a plain loop) or is dropped
        before it (Hugging Face Trainer's ``compute_loss``)."""
        self.index = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op not in ("placeholder", "output"))}
        for n in self.index:  # a value no node reads is freed once computed, as fx's generated code does; the
            if not n.users:   # Interpreter would hold it (and the storage a view of it keeps) to the step's end
                self.user_to_last_uses.setdefault(n, []).append(n)
        self.loss_index = len(self.index)
        self._step = object()
        self._handles: list = []
        self._sent: set[int] = set()
        """Storages of the expanded gradients the loss's backward sent the step's outputs."""

    def step(self, inputs: Inputs, loss_fn: LossFn) -> None:
        self._step = object()  # marks the autograd nodes this step has hooked
        torch.clear_autocast_cache()  # each step casts the parameters itself, as a training step does: the casts
        try:                          # a capture under the same autocast left cached would run unseen
            output = self._run_pytree(inputs) if self._specs() else (
                self.run(*inputs.args) if not inputs.kwargs else self._run_kwargs(inputs))
            loss = self._loss(output, loss_fn)
            if not self.keep_output:
                del output
                self.env = {}  # fx.Interpreter keeps the output node's value
            self.before_backward()
            backward(loss)
            sync(self.device)
            self.after_backward()
        finally:
            for handle in self._handles:
                handle.remove()
            self._handles = []

    def _specs(self):
        return pytree_specs(self.module)

    def _run_pytree(self, inputs: Inputs) -> Any:
        """Graphs from torch.export take flattened inputs (the Interpreter rebuilds the outputs)."""
        in_spec, _ = self._specs()
        return self.run(*flatten_with_spec((inputs.args, inputs.kwargs), in_spec))

    def _run_kwargs(self, inputs: Inputs) -> Any:
        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        args = list(inputs.args)
        for node in placeholders[len(args):]:
            if node.target in inputs.kwargs:
                args.append(inputs.kwargs[node.target])
            elif node.args:
                args.append(node.args[0])
            else:
                raise ProfileError(f"input {node.target!r} of the model is missing from inputs=")
        unknown = set(inputs.kwargs) - {n.target for n in placeholders}
        if unknown:
            raise ProfileError(f"inputs= names {sorted(unknown)} that the model's forward does not take")
        return self.run(*args)

    def _loss(self, output: Any, loss_fn: LossFn) -> torch.Tensor:
        self._sent = set()

        def compute():
            try:
                loss = loss_fn(output)
            except ProfileError:
                raise
            except Exception as exc:
                where = user_frame(exc)
                raise _node_error("loss_fn(output)", where, exc, list(tree_leaves(output)),
                                  "make loss_fn accept the model's output") from exc
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ProfileError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}"
                                   + (f" of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else ""))
            if not loss.requires_grad:
                raise ProfileError("the loss does not require grad: no parameter of the model reaches it; "
                                   "check that the model's output depends on trainable parameters")
            return loss
        return self.around_node(self.loss_index, None, compute, list(tree_leaves(output)))

    def run_node(self, n: fx.Node) -> Any:
        if n.op in ("placeholder", "output"):
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        values = list(tree_leaves((args, kwargs)))

        def compute():
            try:
                return getattr(self, n.op)(n.target, args, kwargs)
            except ProfileError:
                raise
            except Exception as exc:
                raise _node_error(f"node {n.name} ({n.format_node()})", _stack_line(n), exc, values,
                                  "make the model run on inputs of these dtypes, shapes and devices") from exc
        return self.around_node(self.index[n], n, compute, values)

    def around_node(self, index: int, node: fx.Node | None, compute: Callable[[], Any], values: list) -> Any:
        result = compute()
        self._hook_backward(index, result)
        return result

    def _hook_backward(self, index: int, result: Any) -> None:
        for fn in _new_autograd_nodes(result, self._step):
            self._handles.append(fn.register_prehook(lambda grads, i=index: self._before(i, grads)))
            self._handles.append(fn.register_hook(lambda gi, go, i=index: self._after(i, gi)))

    def _before(self, index: int, grads: tuple) -> None:
        if self._sent:
            received = [g for g in _expanded(grads) if storage_id(g.untyped_storage()) in self._sent]
            if received:
                self.on_loss_gradients(index, received)
        self.on_backward(index, "pre")

    def _after(self, index: int, grads: tuple) -> None:
        if index == self.loss_index and self.follows_loss:  # what the loss's backward sends the step's outputs
            self._sent.update(storage_id(g.untyped_storage()) for g in _expanded(grads))
        self.on_backward(index, "post")

    def on_backward(self, index: int, phase: str) -> None:
        """Called before (``pre``) and after (``post``) each autograd node of graph node ``index``."""

    def on_loss_gradients(self, index: int, grads: list[torch.Tensor]) -> None:
        """Called before an autograd node of graph node ``index`` runs, with the expanded gradients it receives that
        are the loss's own (a stride-0 broadcast the loss's backward sent an output, passed on unchanged)."""

    def before_backward(self) -> None:
        """Called once the loss is computed, just before backward."""

    def after_backward(self) -> None:
        """Called once backward has finished, before the step's tensors are dropped."""


def _expanded(grads: tuple) -> list[torch.Tensor]:
    """The gradients in ``grads`` whose storage is smaller than their elements (a broadcast: the sum's gradient is
    one value expanded over its input)."""
    return [g for g in grads if type(g) is torch.Tensor and g.layout is torch.strided
            and g.untyped_storage().nbytes() < g.numel() * g.element_size()]
