"""Runs a plan through the user's own module objects, with forward hooks.

Each checkpointed segment is a *chain*: consecutive calls of sibling modules (``model.layers.3``, or
``model.layers.2`` then ``model.layers.3``, or ``mlp`` alone), each fed with the outputs of the one
before. The first member's forward pre-hook enters torch's non-reentrant checkpoint region (the
generator ``torch.distributed._composable.checkpoint`` uses) with the member's tensor inputs; the
last member's forward hook leaves it. Later members record their inputs, each tensor that *is* an
output of an earlier member (or a whole view of one, as FSDP2's pre-hook hands a unit) replaced by a reference,
so nothing inside the chain is kept alive. In
backward the checkpoint re-runs the chain: every member called again with its recorded inputs.

So the planned module runs the model's own Python code: every method, every shape and every keyword
it accepts, ``generate()``, ``save_pretrained()``. Hooks act only when the module is training with
gradients enabled, as Hugging Face's gradient checkpointing does.

Selective saves: a segment may name ops (any op whose output is fresh memory: a matmul, the attention
kernel, an activation) whose outputs torch's selective checkpointing keeps instead of re-running. The plan
names each by its op name and its occurrence among the segment's ops of that name, as the profile saw them
(``Segment.saved_ops``); the policy counts the ops as the chain's forward dispatches them and returns
``MUST_SAVE`` for those (random ops never), the way torchtitan's policy counts matmuls.

On its first forward a chain watches the code between its members (``_Watch``): a differentiable
op or a random draw there would not be re-run by the recompute, so it is an error naming the
members, raised before the step goes on.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from planner.capture.cache import training_with_grad
from planner.capture.calls import member_call
from planner.capture.ops import draws_random, kernel_name, writes_new_memory
from planner.common.contexts import entered
from planner.compat.sac_autocast import autocast_safe
from planner.compat.torch_private import (
    checkpoint_region,
    tree_flatten,
    tree_unflatten,
)
from planner.errors import PlannerError
from planner.rewrite.graph import COMPILED_CONTEXT, restore_buffers
from planner.rewrite.offload import offloaded_contexts
from planner.rewrite.segment import Segment


class ChainError(PlannerError, RuntimeError):
    """A chain does not match how the model runs (code between its members, members out of order)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Chain:
    """One checkpointed segment as module calls."""

    members: tuple[str, ...]
    """Module paths of consecutive sibling calls, in call order."""
    saved_ops: tuple[tuple[str, int], ...] = ()
    """Ops inside the chain whose fresh outputs selective checkpointing keeps: (op name, its occurrence among
    the chain's ops of that name) (``Segment.saved_ops``)."""
    restore_buffers: tuple[str, ...] = ()
    """Buffers the chain's forward mutates (BatchNorm statistics): put back after the re-run."""
    random: bool = True
    """The chain's forward draws random numbers: its checkpoint stashes the RNG state (``Segment.random``)."""

    @classmethod
    def of(cls, segment: Segment) -> Chain:
        """The chain of a plan's segment (a plan run by hooks)."""
        return cls(members=segment.chain, saved_ops=segment.saved_ops, restore_buffers=segment.restore_buffers,
                   random=segment.random)


class _OutRef(NamedTuple):
    """Stands for leaf ``leaf`` of the flattened output of chain member ``member``."""

    member: int
    leaf: int


class _SavedKernels:
    """Selective checkpointing policy of one forward through a chain: keep the fresh outputs of the ops the plan
    names, each found by its name and its occurrence among the ops of that name since the chain began (the
    way torchtitan's policy counts matmuls). Random ops are never kept. Counts are kept apart for the forward
    and for a re-run, for torch versions that ask the policy in both."""

    def __init__(self, saved: frozenset[tuple[str, int]]) -> None:
        self.saved = saved
        self.seen: tuple[Counter[str], Counter[str]] = (Counter(), Counter())

    def passed(self, op: Any) -> None:
        """An op of the forward that ran past SAC (``planner.rewrite.sac.autocast_safe``): counted, never kept."""
        self.seen[0][kernel_name(op)] += 1

    def policy(self, ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if not writes_new_memory(op):
            return CheckpointPolicy.PREFER_RECOMPUTE
        name = kernel_name(op)
        seen = self.seen[bool(getattr(ctx, "is_recompute", False))]
        occurrence = seen[name]
        seen[name] += 1
        if (name, occurrence) in self.saved and not draws_random(op, args, kwargs):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE


def _kept_ops_contexts(saved: frozenset[tuple[str, int]]) -> tuple:
    """SAC's contexts keeping the ``saved`` ops, counted afresh (the ``context_fn`` of a chain under torch.compile,
    which calls it when it traces the region)."""
    return create_selective_checkpoint_contexts(_SavedKernels(saved).policy)


def _rng_states() -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states.append(torch.cuda.get_rng_state())
    return states


class _Watch(TorchFunctionMode):
    """Notes differentiable ops and random draws that run between a chain's members."""

    def __init__(self) -> None:
        super().__init__()
        self.inside = True
        self.foreign: list[str] = []
        self._rng: list[torch.Tensor] | None = None

    def left_member(self) -> None:
        self.inside, self._rng = False, _rng_states()

    def entered_member(self) -> None:
        if self._rng is not None and not all(torch.equal(a, b) for a, b in zip(self._rng, _rng_states())):
            self.foreign.append("a random draw")
        self.inside = True

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.inside and torch.is_grad_enabled():
            given = {id(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
            made = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if any(id(t) not in given for t in made):  # a call that hands back its own input (``contiguous()`` of
                self.foreign.append(getattr(func, "__name__", repr(func)))  # a contiguous tensor) runs no op
        return out


@dataclass
class _Open:
    """One forward through a chain, between its first member's pre-hook and its last member's hook."""

    region: Any
    """torch's checkpoint generator, paused inside the region."""
    records: list = field(default_factory=lambda: [None])
    """Per member after the first: (pytree spec, input leaves with ``_OutRef`` for chain outputs)."""
    outputs: dict = field(default_factory=dict)
    """id(tensor) -> (weak reference, member, leaf) of the outputs of members run so far."""
    expect: int = 1
    watch: _Watch | None = None


def _output_ref(outputs: dict, tensor: torch.Tensor) -> _OutRef | None:
    """The earlier member's output ``tensor`` is, or is a whole alias of: a pre-hook that runs before ckplan's
    hands the member a view of that output in its place (FSDP2's, which passes a unit's inputs through an
    autograd function to hook their gradients). Recorded as a reference, so the chain keeps none of them."""
    hit = outputs.get(id(tensor))
    if hit is not None and hit[0]() is tensor:
        return _OutRef(hit[1], hit[2])
    base = tensor._base
    if base is None:
        return None
    for ref, member, leaf in outputs.values():  # a chain's members hand on a few tensors
        made = ref()
        if made is not None and (made is base or made._base is base) and _same_view(made, tensor):
            return _OutRef(member, leaf)
    return None


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``b`` looks at exactly what ``a`` holds: the same elements, in the same layout and dtype."""
    return (a.shape == b.shape and a.stride() == b.stride() and a.storage_offset() == b.storage_offset()
            and a.dtype == b.dtype)


def _split_tensors(args: tuple, kwargs: dict) -> tuple[list[torch.Tensor], Callable]:
    """The tensor leaves of a call's arguments, and a function rebuilding the call from new tensors."""
    leaves, spec = tree_flatten((args, kwargs))
    where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    tensors = [leaves[i] for i in where]
    static = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]  # no extra references

    def rebuild(*new: torch.Tensor) -> tuple[tuple, dict]:
        filled = list(static)
        for i, t in zip(where, new):
            filled[i] = t
        return tree_unflatten(filled, spec)

    return tensors, rebuild


class ChainRunner:
    """The hooks and the forward state of one chain."""

    def __init__(self, chain: Chain, members: list[nn.Module], root: nn.Module) -> None:
        self.chain, self.members, self.root = chain, members, root
        self.replaying = False
        self.open: _Open | None = None
        self.checked = False  # the code between members was watched once and found empty

    def __repr__(self) -> str:
        return f"checkpointed chain {' -> '.join(self.chain.members)}"

    @property
    def compiles(self) -> bool:
        """Whether torch.compile can run this chain: one module call, at every call of it (a region entered in
        one hook and left in another, or kept for one call of many, is nothing dynamo can trace)."""
        return len(self.members) == 1 and member_call(self.chain.members[0])[1] is None

    @property
    def random(self) -> bool:
        """The chain's forward draws random numbers (``Chain.random``)."""
        return self.chain.random

    def compiled_contexts(self) -> Callable[[], tuple]:
        """``context_fn`` under torch.compile, a plain function of no state it mutates: the chain's kept ops by
        the same policy, or every op re-run. Buffers are not put back (compiled code updates them once) and
        nothing is offloaded."""
        if not self.chain.saved_ops:
            return COMPILED_CONTEXT
        return functools.partial(_kept_ops_contexts, frozenset(self.chain.saved_ops))  # dynamo takes constants

    def pre(self, j: int, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.replaying:
            return
        if j == 0:
            if self.open is not None:
                self.abort()
                raise ChainError(f"{self}: {self.chain.members[0]} was called again before the chain ended")
            if training_with_grad(module):
                self._start(args, kwargs)
        elif self.open is not None:
            self._enter(self.open, j, args, kwargs)
        elif training_with_grad(module):
            raise ChainError(f"{self}: {self.chain.members[j]} ran without {self.chain.members[0]} just before it")

    def post(self, j: int, module: nn.Module, args: tuple, output: Any) -> None:
        if self.replaying or self.open is None:
            return
        if j < len(self.members) - 1:
            for k, leaf in enumerate(tree_flatten(output)[0]):
                if isinstance(leaf, torch.Tensor):
                    self.open.outputs[id(leaf)] = (weakref.ref(leaf), j, k)
            if self.open.watch is not None:
                self.open.watch.left_member()
        else:
            self._finish(self.open)

    def _start(self, args: tuple, kwargs: dict) -> None:
        tensors, rebuild = _split_tensors(args, kwargs)
        state = _Open(region=None)
        replay = functools.partial(self._replay, state.records, rebuild)
        # preserve_rng_state: dropout inside the chain draws the same numbers when re-run
        state.region = checkpoint_region(replay, *tensors, preserve_rng_state=self.chain.random,
                                         context_fn=self._contexts)
        next(state.region)
        if not self.checked:
            state.watch = _Watch()
            state.watch.__enter__()
        self.open = state

    def _enter(self, state: _Open, j: int, args: tuple, kwargs: dict) -> None:
        if j != state.expect:
            self.abort()
            raise ChainError(f"{self}: {self.chain.members[j]} ran before {self.chain.members[state.expect]}")
        if state.watch is not None:
            state.watch.entered_member()
            if state.watch.foreign:
                found = sorted(set(state.watch.foreign))
                self.abort()
                raise ChainError(
                    f"{self}: {', '.join(found)} ran between {self.chain.members[j - 1]} and "
                    f"{self.chain.members[j]}, which the re-run would skip; plan again (this model's forward "
                    "differs from its captured graph)")
        leaves, spec = tree_flatten((args, kwargs))
        for k, leaf in enumerate(leaves):
            ref = _output_ref(state.outputs, leaf) if isinstance(leaf, torch.Tensor) else None
            if ref is not None:
                leaves[k] = ref
        state.records.append((spec, leaves))
        state.expect = j + 1

    def _finish(self, state: _Open) -> None:
        self.open = None
        state.outputs.clear()
        if state.watch is not None:
            state.watch.__exit__(None, None, None)
            self.checked = not state.watch.foreign
        try:
            next(state.region)
        except StopIteration:
            return
        raise AssertionError("torch's checkpoint region did not close")

    def abort(self) -> None:
        """Closes a region left open (the forward raised, or the chain stopped half-way)."""
        state, self.open = self.open, None
        if state is None:
            return
        if state.watch is not None:
            state.watch.__exit__(None, None, None)
        state.region.close()

    @contextlib.contextmanager
    def _replaying(self):
        self.replaying = True
        try:
            yield
        finally:
            self.replaying = False

    def _contexts(self):
        """``context_fn`` of the region: (forward context, re-run context). Buffers are put back
        outermost: the snapshot and the copy back must run outside SAC's mode."""
        saved = frozenset(self.chain.saved_ops)
        kernels = _SavedKernels(saved)
        forward, rerun = contextlib.nullcontext(), contextlib.nullcontext()
        if saved:
            caching, cached = create_selective_checkpoint_contexts(kernels.policy)
            forward, rerun = offloaded_contexts(*autocast_safe(caching, cached, seen=kernels.passed))
        outer = [restore_buffers(self.root, self.chain.restore_buffers)] if self.chain.restore_buffers else []
        return forward, entered(*outer, rerun, self._replaying())

    def _replay(self, records: list, rebuild: Callable, *tensors: torch.Tensor) -> None:
        """The re-run in backward: every member called again, chain outputs wired to the next member."""
        args, kwargs = rebuild(*tensors)
        outputs: list[list[Any]] = []
        for j, module in enumerate(self.members):
            if j:
                spec, leaves = records[j]
                args, kwargs = tree_unflatten([outputs[x.member][x.leaf] if isinstance(x, _OutRef) else x
                                               for x in leaves], spec)
            outputs.append(tree_flatten(module(*args, **kwargs))[0])
