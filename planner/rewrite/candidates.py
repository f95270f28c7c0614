"""Which single nodes a plan may save inside its segments, and the user's overrides, as node indices.

The torch side of selective checkpointing at planning time: it looks at the captured graph to tell
what a node runs (a Linear, a softmax, a random op), and hands the solver plain ``SaveOptions``.
A candidate must be exact in the memory model (``planner.memory.saves.cacheable``: every output saved for
backward) and safe to cache with SAC: one fresh-output op per node (a ``torch.matmul`` may copy its
operands first, so it is not a candidate), never a random op (``planner.sac`` explains why), never
one that writes buffers. To keep CP-SAT small, each block keeps its ``per_block`` candidates with
the most forward time per cached byte.
"""

from __future__ import annotations

import fnmatch
import operator
from typing import Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from planner.profiling.record import Profile
from planner.rewrite.sac import is_random, writes_new_memory
from planner.memory.saves import SaveOptions, cacheable, cached
from planner.memory.model import MemoryModel
from planner.capture.scope import path_of
from planner.errors import OptionError

_MODULES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.LayerNorm, nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh,
            nn.Sigmoid, nn.Softmax)
"""torch.nn layers that run one op writing fresh memory (views of their input aside)."""
_FUNCTIONS = {F.linear, F.conv1d, F.conv2d, F.conv3d, F.layer_norm, F.gelu, F.relu, F.silu, F.softmax,
              F.log_softmax, torch.tanh, torch.sigmoid, torch.relu, torch.softmax, torch.add, torch.mul,
              operator.add, operator.mul, operator.sub, torch.sub}
_METHODS = {"contiguous", "softmax", "relu", "tanh", "sigmoid", "add", "mul", "sub"}


def is_single_op(node: fx.Node, root: nn.Module) -> bool:
    """A node that runs one fresh-output, non-random ATen op (plus views)."""
    if node.op == "call_module":
        return type(root.get_submodule(node.target)) in _MODULES
    if node.op == "call_method":
        return node.target in _METHODS
    if node.op != "call_function":
        return False
    if isinstance(node.target, torch._ops.OpOverload):  # torch.export: nodes are ATen ops already
        return writes_new_memory(node.target) and not is_random(node.target)
    if node.target is F.scaled_dot_product_attention:
        return node.kwargs.get("dropout_p", 0.0) == 0.0 and len(node.args) < 5
    return node.target in _FUNCTIONS


def save_options(graph_module: fx.GraphModule, profile: Profile, memory: MemoryModel, *,
                 must_save: Sequence[str] = (), must_recompute: Sequence[str] = (), selective: bool = True,
                 per_block: int = 4, savable: frozenset[int] | None = None) -> SaveOptions:
    """The candidates (when ``selective``) and the overrides of one prepared model.

    ``savable``: the only nodes the executor can save (the module executor keeps whole module calls,
    ``planner.memory.chains.alone_in_module``); None for any single-op node.

    Raises:
        OptionError (a ValueError): a pattern matches no node, or asks to re-run a node no segment can hold.
    """
    save = _resolve(profile, must_save, "must_save")
    if savable is not None and save - savable:
        name = profile.nodes[min(save - savable)].name
        raise ValueError(f"must_save matches {name}, which this model's plan cannot keep: it runs the model's own "
                         "modules, so it keeps whole module calls that run one op (a Linear, an activation)")
    recompute = _resolve(profile, must_recompute, "must_recompute")
    owner = memory.regions.chunk_of()
    for o in sorted(recompute):
        if o >= len(owner) or not memory.regions.checkpointable[owner[o]]:
            raise OptionError(f"must_recompute matches {profile.nodes[o].name}, which no checkpointed segment "
                              "can hold (it writes an input in place, or it is the loss)")
    both = save & recompute
    if both:
        raise OptionError(f"{profile.nodes[min(both)].name} matches both must_save and must_recompute")
    candidates: tuple[int, ...] = ()
    # Under autocast, its process-wide weight-cast cache makes a segment's re-run dispatch a different
    # number of _to_copy ops than its forward, which breaks SAC's per-op counters (pytorch#193338:
    # "invocation index N ... not found in storage"): plans profiled with cached casts save nothing.
    if selective and not memory.fwd_fixed.any():
        by_node = {n.name: n for n in graph_module.graph.nodes}
        root = graph_module
        ok = [i for i, nd in enumerate(profile.nodes[:memory.regions.end])
              if nd.name in by_node and not nd.mutated_buffers and cacheable(memory, i)
              and is_single_op(by_node[nd.name], root) and (savable is None or i in savable)]
        # a save must at least pay for SAC's dispatch cost over its own chunk (a heuristic cut: several
        # cheap saves sharing one segment could pay together), so CP-SAT only runs when saves can win
        worth = [o for o in ok if memory.node_cost_us[o] > (memory.sac_chunk_us[owner[o]]
                                                           if len(memory.sac_chunk_us) else 0)]
        candidates = tuple(sorted(set(_best_per_block(memory, worth, per_block)) | (save & set(ok))))
    return SaveOptions(candidates=candidates, must_save=frozenset(save), must_recompute=frozenset(recompute))


def every_save(graph_module: fx.GraphModule, profile: Profile, memory: MemoryModel, plan) -> frozenset:
    """Every save the segments of ``plan`` (chunk ranges) allow, SAC's charge aside: each candidate
    whose ``partner`` shares its segment, in node order, kept when the memory model accepts it next to
    the ones before. For tests and benchmarks that force saves (the solver weighs their cost)."""
    import dataclasses

    from planner.memory.saves import partner, segment_of
    from planner.memory.simulate import simulate

    seg = segment_of(memory, plan)
    free = dataclasses.replace(memory, sac_chunk_us=memory.sac_chunk_us * 0)  # every candidate, paying or not
    saves: frozenset = frozenset()
    for o in save_options(graph_module, profile, free).candidates:
        if seg[o] >= 0 and seg[partner(memory, o)] == seg[o]:
            try:
                simulate(memory, plan, saves | {o})
            except ValueError:  # a later segment reads a storage only SAC's cache would hold
                continue
            saves |= {o}
    return saves


def _best_per_block(memory: MemoryModel, nodes: list[int], per_block: int) -> list[int]:
    """The ``per_block`` nodes of each block (and of what lies outside blocks) with the most forward
    time per cached byte."""
    owner = memory.regions.chunk_of()
    block_of = {}
    for b, (first, stop) in enumerate(memory.regions.blocks):
        for k in range(first, stop):
            block_of[k] = b
    groups: dict[int, list[int]] = {}
    for o in nodes:
        groups.setdefault(block_of.get(owner[o], -1), []).append(o)
    out = []
    for members in groups.values():
        members.sort(key=lambda o: -memory.node_cost_us[o] / max(1, int(memory.size[cached(memory, o)].sum())))
        out.extend(members[:per_block])
    return out


def _resolve(profile: Profile, patterns: Sequence[str], what: str) -> set[int]:
    """Node indices matched by glob patterns on module paths, node names and op names."""
    if isinstance(patterns, str):
        patterns = [patterns]
    out: set[int] = set()
    for pattern in patterns:
        if not isinstance(pattern, str) or not pattern:
            raise OptionError(f"{what} takes module paths or op names (glob patterns), got {pattern!r}")
        hits = {i for i, nd in enumerate(profile.nodes[:-1]) if nd.kind != "get_attr" and any(
            fnmatch.fnmatchcase(text, pattern) for text in _names(nd))}
        if not hits:
            raise OptionError(f"{what} pattern {pattern!r} matches no module path or op name of the graph")
        out |= hits
    return out


def _names(node) -> tuple[str, ...]:
    """What a pattern can match: the node name, its module path and the paths of the modules around it,
    the op it calls, ``path:op``."""
    op = node.target.rsplit(".", 1)[-1]
    paths = tuple(dict.fromkeys(path_of(entry) for entry in node.scope))
    return (node.name, node.module_path, node.target, op, f"{node.module_path}:{op}", *paths)
