"""Runs op-level saves with torch's own selective checkpointing (SAC).

A segment with saved nodes is called through ``checkpoint(..., use_reentrant=False,
context_fn=...)`` whose contexts come from ``create_selective_checkpoint_contexts``. Its generated
code brackets every saved node with ``sac_mark(True)`` / ``sac_mark(False)`` (plain Python calls,
no ATen ops), and the policy returns ``MUST_SAVE`` for the ops that run inside a bracket and write
new memory, ``PREFER_RECOMPUTE`` for everything else. The forward and the re-run execute the same
code, so the brackets mark the same ops in both.

Under ``torch.compile`` the same brackets and the same policy decide. ``sac_mark`` is registered with
``torch.compiler.allow_in_graph`` (``trace_marks_into_graphs``), so dynamo writes each call into the
checkpointed body graph in order instead of dropping the thread-local store; AOTAutograd runs that
body with the policy's dispatch mode (``compiled_sac_contexts``), the calls set the flag between the
same ops as in eager, and the policy's answer becomes each traced node's ``meta["recompute"]``, which
the partitioner obeys (MUST_SAVE outputs are kept for backward, the rest of the segment re-run).

Random ops (ATen tag ``nondeterministic_seeded``: dropout, bernoulli, rand...) are never saved: they
are always re-run, in their original order, from the RNG state checkpoint restores, so each draws
the numbers it drew in forward. A saved random op would be skipped by the re-run and shift the
numbers of every later random op of the segment.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from planner.capture.ops import draws_random, writes_new_memory
from planner.compat.torch_private import OpOverload, TorchDispatchMode

_state = threading.local()


def sac_mark(saving: bool) -> None:
    """Marks the start (True) or end (False) of a saved node in generated segment code."""
    _state.saving = saving


@functools.cache
def trace_marks_into_graphs() -> None:
    """Has dynamo keep ``sac_mark`` calls in its graphs (called once by the rewriter for a plan with
    saves; importing ``torch._dynamo`` costs ~1 s, so not at import). Without it dynamo treats the
    thread-local store as a side effect outside the graph, AOTAutograd never sees the brackets and
    every op of the segment is recomputed."""
    torch.compiler.allow_in_graph(sac_mark)
    torch.fx.node.has_side_effect(sac_mark)  # no outputs: dead-code elimination must keep it


def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Save the fresh outputs of the ops of a marked node; recompute the rest (random ops always)."""
    if getattr(_state, "saving", False) and writes_new_memory(op) and not draws_random(op, args, kwargs):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


_TO_COPY = torch.ops.aten._to_copy.default


def is_parameter_cast(func: Any, args: tuple) -> bool:
    """Whether an op is a cast of a parameter (a leaf that requires grad): what autocast caches."""
    return func is _TO_COPY and bool(args) and isinstance(args[0], torch.Tensor) and args[0].is_leaf and \
        args[0].requires_grad


class _ParameterCastsAside(TorchDispatchMode):
    """SAC's dispatch mode ``inner`` with autocast's casts of parameters kept out of it.

    Autocast caches each parameter's cast for as long as its outermost ``torch.autocast`` is open, so a segment's
    forward and its re-run dispatch different numbers of ``_to_copy`` ops: a parameter cast already cached skips
    the op in one and not in the other (a backward run inside the forward's ``torch.autocast`` re-runs with the
    forward's casts cached; one run outside starts with none). SAC numbers the ops of each kind in both and pairs
    them by number, so every later ``_to_copy`` of the segment would be paired with another's output, or fail
    with "invocation index N ... not found in storage" (pytorch#193338). Parameter casts are never saved (the
    memory model keeps autocast's cache out of the save candidates), so they run here past SAC, uncounted, in
    both; ``seen`` hears of each in the forward (a policy that numbers ops by name counts them as the profile
    did)."""

    def __init__(self, inner: Any, seen: Callable[[Any], None] | None = None) -> None:
        super().__init__()
        self.inner, self.seen = inner, seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if is_parameter_cast(func, args):
            if self.seen is not None:
                self.seen(func)
            return func(*args, **kwargs)
        return self.inner.__torch_dispatch__(func, types, args, kwargs)


def autocast_safe(forward: Any, recompute: Any, seen: Callable[[Any], None] | None = None) -> tuple[Any, Any]:
    """SAC's (forward, re-run) modes, each with autocast's parameter casts kept out of it where the forward runs
    under ``torch.autocast`` (``_ParameterCastsAside``); as they are outside one."""
    if not (torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")):
        return forward, recompute
    return _ParameterCastsAside(forward, seen), _ParameterCastsAside(recompute)


@contextlib.contextmanager
def _both(first, second):
    with first, second:
        yield


def sac_contexts(module: nn.Module, restore: Sequence[str], restore_buffers) -> tuple:
    """``context_fn`` result of a segment with saves: SAC's forward and recompute modes, the
    recompute one combined with putting ``restore`` buffers back (BatchNorm statistics)."""
    _state.saving = False
    forward, recompute = autocast_safe(*create_selective_checkpoint_contexts(policy))
    if restore:
        # outermost: the snapshot and the copy back must run outside SAC's mode, which only knows
        # the segment's own ops
        recompute = _both(restore_buffers(module, restore), recompute)
    return forward, recompute


def compiled_sac_contexts() -> tuple:
    """``context_fn`` of a segment with saves under torch.compile (which takes plain functions only):
    the same policy. BatchNorm buffers need no restoring there: compiled code applies buffer updates
    once, whatever it recomputes."""
    _state.saving = False
    return create_selective_checkpoint_contexts(policy)


_MODULES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.LayerNorm, nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh,
            nn.Sigmoid, nn.Softmax)
"""torch.nn layers that run one op writing fresh memory (views of their input aside)."""
_FUNCTIONS = {F.linear, F.conv1d, F.conv2d, F.conv3d, F.layer_norm, F.gelu, F.relu, F.silu, F.softmax,
              F.log_softmax, torch.tanh, torch.sigmoid, torch.relu, torch.softmax, torch.add, torch.mul,
              operator.add, operator.mul, operator.sub, torch.sub}
_METHODS = {"contiguous", "softmax", "relu", "tanh", "sigmoid", "add", "mul", "sub"}


def is_single_op(node: fx.Node, root: nn.Module) -> bool:
    """A node that runs one fresh-output, non-random ATen op (plus views): what selective checkpointing can
    keep exactly, as one node of the memory model."""
    if node.op == "call_module":
        assert isinstance(node.target, str)  # a call_module node's target is the module's path
        return type(root.get_submodule(node.target)) in _MODULES
    if node.op == "call_method":
        return node.target in _METHODS
    if node.op != "call_function":
        return False
    if isinstance(node.target, OpOverload):  # ATen graphs: nodes are ATen ops already
        return writes_new_memory(node.target) and not draws_random(node.target, node.args, node.kwargs)
    if node.target is F.scaled_dot_product_attention:
        return bool(node.kwargs.get("dropout_p", 0.0) == 0.0) and len(node.args) < 5
    return node.target in _FUNCTIONS
