"""Per-node forward and backward times of a training step measured piece by piece.

The profile's timed pass (``timing.Timer``) runs one whole un-checkpointed step and so holds every
activation until backward: exactly what a model that needs checkpointing cannot afford. Its memory
can come from a meta-tensor replay (``meta.py``), but its times must be measured on the device.
Here the captured graph runs in contiguous pieces of nodes: each piece's forward is timed node by
node as ``Timer`` does, then its backward runs from the values later pieces read (seeded with
ones), then its graph is dropped. The values crossing into the next piece go on as detached leaves
behind a no-copy autograd seam, so autograd builds only the current piece's graph. Memory held at
any time: parameters, gradients, the values crossing the current boundary, the current piece's
activations and its backward.

It lives in ``profiling/`` beside ``timing.py``: the same runner (``runner.StepRunner``), the same
backward hooks and ``StepTimes``, so a piecewise profile's times are measured like a whole step's.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from planner.capture.api import Captured
from planner.capture.inputs import Inputs
from planner.capture.step import LossFn, default_loss, untouched
from planner.compat.torch_private import tree_leaves, tree_map_only
from planner.errors import ProfileError
from planner.profiling.memory_pass import StepTimes, check_trainable, device_of
from planner.profiling.runner import SEEN_KEY
from planner.profiling.timing import TIMING_RUNS, Timer, checkpoint_overhead_ms

Piece = tuple[int, int]
"""``[lo, hi)`` over graph node indices (the loss is node ``node_count``, in the last piece)."""


def node_count(gm: fx.GraphModule) -> int:
    """Number of profiled nodes of ``gm``: every node but placeholders and the output (the loss excluded)."""
    return sum(n.op not in ("placeholder", "output") for n in gm.graph.nodes)


def even_pieces(n_nodes: int, k: int) -> list[Piece]:
    """``k`` contiguous pieces of ``n_nodes`` nodes, as even as integers allow (at most one per node).

    Args:
        n_nodes: the graph's node count (``node_count``); the loss joins the last piece.
        k: how many pieces wanted (clipped to ``[1, n_nodes]``).

    Returns:
        ``[(lo, hi), ...]`` covering ``[0, n_nodes)`` in order.
    """
    k = max(1, min(k, n_nodes))
    bounds = [i * n_nodes // k for i in range(k + 1)]
    return list(itertools.pairwise(bounds))


def check_pieces(pieces: Sequence[Piece], n_nodes: int) -> None:
    """Raises ValueError unless ``pieces`` are non-empty ``[lo, hi)`` ranges covering nodes ``0..n_nodes-1``
    in order, the last ending at ``n_nodes`` or ``n_nodes + 1`` (the loss)."""
    ends_ok = bool(pieces) and pieces[0][0] == 0 and pieces[-1][1] in (n_nodes, n_nodes + 1)
    if not ends_ok or any(lo >= hi for lo, hi in pieces) or any(a[1] != b[0] for a, b in itertools.pairwise(pieces)):
        raise ValueError(f"pieces must be contiguous non-empty [lo, hi) ranges covering nodes 0..{n_nodes - 1} "
                         f"in order, the last ending at {n_nodes} (or {n_nodes + 1}: the loss); got {list(pieces)}")


class _Seam(torch.autograd.Function):
    """Identity that makes a detached leaf a non-leaf sharing its storage: the next piece may modify a
    crossing value in place (``out += x``, ``ReLU(inplace=True)``), which autograd forbids on leaves and
    their views, and its gradient still reaches the leaf (where ``PieceTimer`` notes and drops it)."""

    @staticmethod
    def forward(ctx: Any, leaf: torch.Tensor) -> torch.Tensor:
        return leaf.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


@contextlib.contextmanager
def _no_autocast(device: torch.device) -> Iterator[None]:
    """Backward outside autocast, as ``planner.capture.step.backward`` runs the loss's."""
    if (device.type != "meta" and torch.is_autocast_enabled(device.type)) or torch.is_autocast_enabled("cpu"):
        with torch.autocast(device.type, enabled=False), torch.autocast("cpu", enabled=False):
            yield
    else:
        yield


class PieceTimer(Timer):
    """``Timer`` run piece by piece: before each piece's first node, the previous piece's backward runs
    and the values crossing the boundary are detached (``_boundary``).

    Which crossing values to seed with a gradient is learnt from the previous step: those whose leaf
    received one from a later piece (the first step seeds every value that requires grad). A value a
    later piece only reads without differentiating (``h > 0``) thus gets no backward, as in a real step.
    """

    def __init__(self, gm: fx.GraphModule, device: torch.device, pieces: Sequence[Piece]) -> None:
        super().__init__(gm, device)
        check_pieces(pieces, self.loss_index)
        self._starts = {lo for lo, _ in pieces[1:]}
        position = {**self.index, **{n: self.loss_index for n in gm.graph.nodes if n.op == "output"}}
        self._last_use = {n: max((position[u] for u in n.users), default=-1) for n in gm.graph.nodes}
        self._wanted: set[tuple] | None = None
        self._reached: set[tuple] = set()

    def step(self, inputs: Inputs, loss_fn: LossFn) -> None:
        self._reached = set()
        super().step(inputs, loss_fn)
        self._wanted = self._reached

    def clear_times(self) -> None:
        """Forgets the times recorded so far (after a warm-up step)."""
        self._fwd.clear()
        self._bwd.clear()

    def run_node(self, n: fx.Node) -> Any:
        index = self.loss_index if n.op == "output" else self.index.get(n)
        if index in self._starts:
            self._boundary(index)
        return super().run_node(n)

    def _boundary(self, lo: int) -> None:
        """Ends the piece before node ``lo``: runs its backward, drops values no later node reads, and
        replaces the values it produced that later nodes read by seamed detached leaves."""
        for node in [n for n in self.env if self._last_use[n] < lo]:
            del self.env[node]  # read by no node (e.g. ``keep_args``): nothing later needs it
        produced = self._produced_here(lo)
        seeds = [t for key, t in produced if self._wanted is None or key in self._wanted]
        if seeds:
            with _no_autocast(self.device):
                torch.autograd.backward(seeds, [torch.ones_like(t) for t in seeds])
        del seeds
        for handle in self._handles:
            handle.remove()
        self._handles = []
        seams = {id(t): self._seam(t, key) for key, t in produced}
        for node, value in self.env.items():
            self.env[node] = tree_map_only(torch.Tensor, lambda t: seams.get(id(t), t), value)

    def _produced_here(self, lo: int) -> list[tuple[tuple, torch.Tensor]]:
        """``(key, tensor)`` of each distinct live tensor whose autograd graph is this piece's: values
        produced in it, and earlier values it modified in place (their seam replaced by its op)."""
        seen: set[int] = set()
        found = []
        for node, value in self.env.items():
            for i, leaf in enumerate(tree_leaves(value)):
                if (isinstance(leaf, torch.Tensor) and leaf.grad_fn is not None and id(leaf) not in seen
                        and not isinstance(leaf.grad_fn, _Seam._backward_cls)):
                    seen.add(id(leaf))
                    found.append(((lo, node.name, i), leaf))
        return found

    def _seam(self, tensor: torch.Tensor, key: tuple) -> torch.Tensor:
        leaf = tensor.detach().requires_grad_()
        leaf.register_post_accumulate_grad_hook(functools.partial(self._on_grad, key))
        with torch.enable_grad():  # a boundary inside the model's no_grad region still gets a seam
            out = _Seam.apply(leaf)
        out.grad_fn.metadata[SEEN_KEY] = self._step  # not the backward of the node that reads it
        return out

    def _on_grad(self, key: tuple, leaf: torch.Tensor) -> None:
        self._reached.add(key)
        leaf.grad = None  # the gradient would have gone on into the earlier piece; free it now


def time_in_pieces(
    captured: Captured,
    model: nn.Module,
    inputs: Inputs,
    *,
    pieces: Sequence[Piece],
    loss_fn: LossFn | None = None,
    device: torch.device | None = None,
    runs: int = TIMING_RUNS,
) -> StepTimes:
    """Per-node forward and backward times of one training step of ``captured``, measured in pieces.

    One warm-up step (which also learns which crossing values a later piece differentiates), then
    ``runs`` timed steps; each time is the fastest of them. Nothing of the model changes: buffers
    (BatchNorm statistics), gradients, RNG state and train/eval flags are restored.

    Args:
        captured: the traced model (fx, ATen or torch.export graph: flattened inputs are handled).
        model: the model itself.
        inputs: example inputs.
        pieces: contiguous ``[lo, hi)`` node ranges covering the graph (``even_pieces``, ``check_pieces``).
        loss_fn: ``output -> scalar``; default ``default_loss``.
        device: where to time; default the model's.
        runs: timed steps.

    Returns:
        ``StepTimes`` (ms): per node (the loss last) forward and backward, their sums as the step's
        times, ``checkpoint_overhead_ms`` measured on the device, ``sac_op_us`` None (not measured).

    Raises:
        ValueError: ``pieces`` do not cover the graph.
        ProfileError: a node failed, the model has nothing to differentiate, or it is on the meta device.
    """
    loss_fn = loss_fn or default_loss
    device = device or device_of(model, inputs)
    if device.type == "meta":
        raise ProfileError("time_in_pieces times a real device; a model on the meta device has no times to "
                           "measure (planner.profiling.meta estimates them)")
    check_trainable(model)
    timer = PieceTimer(captured.graph_module, device, pieces)
    with untouched(model):
        timer.step(inputs, loss_fn)
        timer.clear_times()
        for _ in range(max(1, runs)):
            timer.step(inputs, loss_fn)
    count = timer.loss_index + 1
    fwd = [timer.fwd_ms(i) for i in range(count)]
    bwd = [timer.bwd_ms(i) for i in range(count)]
    return StepTimes(fwd_ms=fwd, bwd_ms=bwd, step_fwd_ms=sum(fwd), step_bwd_ms=sum(bwd),
                     checkpoint_overhead_ms=checkpoint_overhead_ms(device))
