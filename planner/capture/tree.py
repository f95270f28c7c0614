"""Copies of a model's module tree that ckplan can change without touching the user's model.

``clone_tree`` makes every module a new object of its class with its own containers (parameters, buffers,
children, hook dicts), sharing every tensor and other attribute: a planned module built on it has the
user's class, methods and weights, and nothing done to it (``train()``, hooks) reaches the model.
``private_copy`` goes further for a forward that ckplan runs itself (capturing or replaying a shape while
training goes on): own buffers, parameters that alias the user's storage but hold their own ``.grad``, and
none of the hooks ckplan put on the model, so an error or a Ctrl-C half-way leaves the model as it was.
``meta_copy`` gives the same tree with every tensor on the meta device, for replays that allocate nothing.
``copy_runs_alone`` checks that a copy's forward never reaches the model it was made from.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator
from types import MethodType

import torch
from torch import nn

from planner.errors import CaptureError

_CONTAINERS = tuple(key for key, value in vars(nn.Module()).items() if isinstance(value, (dict, set)))
"""nn.Module's own per-instance containers (parameters, buffers, children, every hook dict)."""


def clone_tree(*roots: nn.Module) -> tuple[nn.Module, ...]:
    """Each root's modules as new objects of their classes with their own containers, sharing every
    parameter, buffer and other attribute but methods bound to the module on the instance (rebound to the new
    object: accelerate sets ``model.forward`` so) and callables that hold the module and can be ``rebound`` to
    another (a plan's checkpointed forwards); a module reachable twice (within or across the roots) is
    cloned once, so the clones share what the originals share."""
    memo: dict[int, nn.Module] = {}

    def clone(module: nn.Module) -> nn.Module:
        if id(module) in memo:
            return memo[id(module)]
        new = object.__new__(type(module))  # not GraphModule.__new__, which makes a class without forward
        state = dict(vars(module))
        for key in _CONTAINERS:
            if key in state:
                state[key] = state[key].copy()
        for key, value in state.items():  # a forward set on the instance (accelerate's autocast wrapper) bound to
            if isinstance(value, MethodType) and value.__self__ is module:  # the module runs the clone, not it
                state[key] = MethodType(value.__func__, new)
            elif getattr(value, "module", None) is module and callable(getattr(value, "rebound", None)):
                state[key] = value.rebound(new)  # a forward that knows its module (a plan's checkpointed one)
        new.__dict__.update(state)
        memo[id(module)] = new
        for name, child in module._modules.items():
            if child is not None:
                new._modules[name] = clone(child)
        return new

    return tuple(clone(root) for root in roots)


def private_copy(*roots: nn.Module, drop_hooks: Collection[int] = ()) -> tuple[nn.Module, ...]:
    """``clone_tree`` with state of its own: each buffer a copy, each parameter a new ``nn.Parameter`` on the
    same storage (so ``.grad`` and ``requires_grad_`` are its own), and the hooks whose handle ids are in
    ``drop_hooks`` left out. Tied tensors stay tied."""
    copies = clone_tree(*roots)
    _retensor(copies, lambda t: nn.Parameter(t.detach(), requires_grad=t.requires_grad)
              if isinstance(t, nn.Parameter) else t.detach().clone())
    if drop_hooks:
        for root in copies:
            for module in root.modules():
                for key in _CONTAINERS:
                    hooks = module.__dict__.get(key)
                    if isinstance(hooks, dict):
                        for handle_id in drop_hooks:
                            hooks.pop(handle_id, None)
    return copies


def meta_copy(*roots: nn.Module, convert: Callable[[torch.Tensor], torch.Tensor]) -> tuple[nn.Module, ...]:
    """``clone_tree`` with every parameter, buffer and tensor attribute replaced by ``convert(tensor)`` (a meta
    copy), one per tensor, so shared weights stay shared; the originals are never touched."""
    copies = clone_tree(*roots)
    _retensor(copies, convert, attributes=True)
    return copies


def _retensor(roots: tuple[nn.Module, ...], convert: Callable[[torch.Tensor], torch.Tensor], *,
              attributes: bool = False) -> None:
    """Replaces the parameters and buffers of the (cloned) modules, and with ``attributes`` their plain tensor
    attributes too, by ``convert(tensor)``, once per tensor (a module reached from two roots once)."""
    done: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    for root in roots:
        for module in root.modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            stores: list[dict] = [module._parameters, module._buffers, *([module.__dict__] if attributes else [])]
            for store in stores:
                for key, value in list(store.items()):
                    if isinstance(value, torch.Tensor):
                        if id(value) not in done:
                            done[id(value)] = convert(value)
                        store[key] = done[id(value)]


@contextlib.contextmanager
def copy_runs_alone(original: nn.Module) -> Iterator[None]:
    """While a copy of ``original`` runs: a module of ``original`` itself running raises ``CaptureError``. A
    forward wrapper can hold the original's bound forward in a closure, which no copy rebinds (TRL's fused LM
    head calls it when ``fused_lm_head`` is not passed); the copy's graph would then be the user's model's, with
    its plan's hooks, not the copy's."""
    paths = {id(module): path for path, module in original.named_modules()}

    def refuse(module: nn.Module, args: object) -> None:
        path = paths.get(id(module))
        if path is not None:
            raise CaptureError(f"the copy of the model ckplan plans on ran the model's own {path or 'root'} module (a "
                               "forward wrapper holding the model's bound forward, such as TRL's fused LM head "
                               "called without fused_lm_head=True): plan with the arguments the training calls pass")

    handle = nn.modules.module.register_module_forward_pre_hook(refuse)
    try:
        yield
    finally:
        handle.remove()
