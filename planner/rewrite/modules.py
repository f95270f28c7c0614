"""The planned module of the hook executor: the user's model (or a clone of it, ``planner.capture.tree.clone_tree``)
with a plan's chains installed as hooks, ``use_cache`` turned off while training, and a warning for inputs larger
than the plan was made for; or with a plan that switches per training call (``planner.rewrite.switching``).

The clone is a new object of the model's exact class, and so is every submodule in it, each sharing
its parameters, buffers and attributes with the user's: ``type(clone) is type(model)``, every method
works, ``state_dict()`` has the same keys and tensors, and nothing done to the clone (``train()``,
hooks, Hugging Face's lazily installed output hooks) reaches the model. The plan on a module tree is found by
the hook it has on the tree's root (``_plan_on``), so that a new plan replaces an old one and ``disable`` takes
it off, and nothing keeps a planned model alive. A copy of a planned tree (``pickle``, ``torch.save``,
``copy.deepcopy``) carries copies of its plan and of the plan's hooks, which act on the copy's own modules.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from planner.capture.cache import install_no_cache, training_with_grad
from planner.capture.frameworks import guard, unguard
from planner.capture.inputs import bind
from planner.common.budget import format_bytes
from planner.compat.torch_private import forward_hooks, graph_breaker
from planner.rewrite.chain_hooks import Installed, install
from planner.rewrite.chains import Chain
from planner.rewrite.segment import Segment
from planner.rewrite.switching import Chooser, Switching


@dataclass(frozen=True, kw_only=True, slots=True)
class PlannedShapes:
    """What the plan was made for, to notice calls it does not cover."""

    shapes: dict[str, tuple[int, ...]]
    """Shape of each tensor argument of the example call, by parameter name."""
    predicted_peak_bytes: int
    fixed_bytes: int
    """Part of the predicted peak that does not grow with the inputs (parameters, gradients, state)."""
    budget_bytes: int


class _ShapeWarning:
    """Forward pre-hook: warns once when a training call has inputs larger than the planned ones,
    with the peak predicted at that size (activations scaled with the input elements)."""

    def __init__(self, planned: PlannedShapes) -> None:
        self.planned = planned
        self.warned = False

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.warned or not training_with_grad(module):
            return
        bound = bind(module, args, kwargs) or {}
        ratio, what = 0.0, ""
        for name, shape in self.planned.shapes.items():
            value = bound.get(name)
            if isinstance(value, torch.Tensor) and value.dim() == len(shape) and \
                    any(a > b for a, b in zip(value.shape, shape)):
                scale = value.numel() / max(1, math.prod(shape))
                if scale > ratio:
                    ratio, what = scale, f"{name} {list(value.shape)} (planned {list(shape)})"
        if not what:
            return
        self.warned = True
        p = self.planned
        estimate = p.fixed_bytes + (p.predicted_peak_bytes - p.fixed_bytes) * max(ratio, 1.0)
        warnings.warn(f"ckplan: {what} is larger than the inputs this plan was made for: its peak there is "
                      f"about {format_bytes(int(estimate))} (activations scaled with the input size; the budget "
                      f"is {format_bytes(p.budget_bytes)}); plan with the largest batch: "
                      "optimize(model, budget, inputs=<that batch>)", stacklevel=2)


def install_plan(root: nn.Module, chains: Sequence[Chain], *, planned: PlannedShapes | None) -> Installed:
    """The chains' hooks on ``root``, plus ``use_cache=False`` while training and the shape warning;
    a plan installed on ``root`` before is removed first."""
    remove_plan(root)
    installed = install(root, chains)
    handle = install_no_cache(root, warn=True) if chains else None
    if handle is not None:
        installed.handles.append(handle)
    if planned is not None:
        installed.handles.append(root.register_forward_pre_hook(_ShapeWarning(planned), with_kwargs=True))
    guard(root)  # the model's own forward runs: its framework's checkpointing stays off (capture/frameworks)
    return installed


def install_switching(root: nn.Module, chooser: Chooser, first: tuple[Hashable, Sequence[Segment]] | None) -> Switching:
    """A plan that changes with the training call on ``root`` (``planner.rewrite.switching``), ``first``'s
    chains installed now; a plan installed on ``root`` before is removed first."""
    remove_plan(root)
    switching = Switching(root, chooser, first)
    guard(root)
    return switching


def own_hooks(root: nn.Module) -> frozenset[int]:
    """Ids of the hooks of the plan installed on ``root`` (none: empty), which copies ckplan runs leave out."""
    installed = _plan_on(root)
    return installed.hook_ids() if installed is not None else frozenset()


def remove_plan(root: nn.Module) -> bool:
    """Takes the hooks ``install_plan`` (or ``install_switching``) put on ``root`` off again and gives the model's
    framework its own checkpointing back; True if there was a plan."""
    unguard(root)
    installed = _plan_on(root)
    if installed is None:
        return False
    installed.remove()
    return True


def break_graph_after(root: nn.Module, module: nn.Module) -> None:
    """Ends dynamo's graph after each call of ``module``, a member of ``root`` (a forward hook; in eager code it
    does nothing): part of the plan on ``root``, taken off with it by ``remove_plan``."""
    handle = module.register_forward_hook(_graph_break_after)
    installed = _plan_on(root)
    if isinstance(installed, Installed):
        installed.handles.append(handle)


_graph_break = graph_breaker()


def _graph_break_after(module: nn.Module, args: tuple, output: object) -> None:
    _graph_break()


def _plan_on(root: nn.Module) -> Installed | Switching | None:
    """The plan installed on ``root`` (a copy of a planned tree included), found by the hook it has on ``root``
    itself, so that no registry keeps a planned model alive: a ``Switching`` is a forward pre-hook, an
    ``Installed`` closes the forward with ``_closed`` (a ``Switching``'s current plan does too, so the
    ``Switching`` is looked for first). A clone sharing the hooks of another tree finds none of its own."""
    pre_hooks, hooks = forward_hooks(root)
    for hook in pre_hooks:
        if isinstance(hook, Switching) and hook.root is root:
            return hook
    for hook in hooks:
        owner = getattr(hook, "__self__", None)
        if isinstance(owner, Installed) and owner.root is root:
            return owner
    return None


def describe(chains: Sequence[Chain], model: nn.Module) -> str:
    """What ``--emit`` writes for a module-executor plan: the chains, as comments a reviewer can read."""
    lines = [f"# ckplan plan for {type(model).__name__}: the model's own forward runs; while training with",
             "# gradients, each chain below is one torch.utils.checkpoint region (non-reentrant), entered and",
             "# left by forward hooks; 'keeps' lists the ops (name, occurrence in the chain) whose outputs",
             "# selective checkpointing keeps.",
             "CHAINS = ["]
    for chain in chains:
        keeps = f"  # keeps {', '.join(f'{name}#{k}' for name, k in chain.saved_ops)}" if chain.saved_ops else ""
        lines.append(f"    {list(chain.members)!r},{keeps}")
    return "\n".join([*lines, "]"]) + "\n"
