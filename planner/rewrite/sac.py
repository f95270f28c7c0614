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

import functools
import operator
import threading
from collections.abc import Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from planner.capture.ops import draws_random, writes_new_memory
from planner.common.contexts import entered
from planner.compat.sac_autocast import autocast_safe
from planner.compat.torch_private import OpOverload
from planner.rewrite.offload import offloaded_contexts

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


def sac_contexts(module: nn.Module, restore: Sequence[str], restore_buffers) -> tuple:
    """``context_fn`` result of a segment with saves: SAC's forward and recompute modes (with the plan's
    offloads of what they cache), the recompute one combined with putting ``restore`` buffers back
    (BatchNorm statistics)."""
    _state.saving = False
    forward, recompute = offloaded_contexts(*autocast_safe(*create_selective_checkpoint_contexts(policy)))
    if restore:
        # outermost: the snapshot and the copy back must run outside SAC's mode, which only knows
        # the segment's own ops
        recompute = entered(restore_buffers(module, restore), recompute)
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
