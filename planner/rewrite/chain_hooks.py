"""A plan's chains put on a module tree: the hooks that route each call of a member module to the chains that name
it (``cell#7``) or every call (``cell``), restart call counting at the root's forward and close what a forward left
open; ``install`` puts them on, ``Installed.remove`` takes them off (``planner.rewrite.chains`` runs each chain)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from planner.capture.calls import member_call
from planner.compat.torch_private import skip_checkpoint_side_effects_in_backward
from planner.rewrite.chains import Chain, ChainError, ChainRunner
from planner.rewrite.compiled_forward import CheckpointedForward, refuse_compiled


@dataclass(kw_only=True, slots=True)
class Installed:
    """A plan's hooks on a module tree; ``remove()`` takes every one of them off again."""

    root: nn.Module
    runners: list[ChainRunner]
    handles: list
    calls: list[_Calls]
    forwards: list[CheckpointedForward] = field(default_factory=list)
    """The forwards put on the members of chains of one module call (what torch.compile runs)."""

    def hook_ids(self) -> frozenset[int]:
        """Ids of the hooks this plan put on the module tree."""
        return frozenset(handle.id for handle in self.handles)

    def remove(self) -> None:
        for runner in self.runners:
            runner.abort()
        for handle in self.handles:
            handle.remove()
        self.handles = []
        for forward in self.forwards:
            forward.remove()
        self.forwards = []

    def _restart(self, module: nn.Module, args: tuple) -> None:
        """Before the root's forward: call indices count from here."""
        if torch.compiler.is_compiling():  # compiled code runs the chains' forwards (CheckpointedForward)
            return
        for each in self.calls:
            each.restart()

    def _closed(self, module: nn.Module, args: tuple, output: Any) -> None:
        """After the root's forward: a chain still open stopped half-way (or the forward raised)."""
        if torch.compiler.is_compiling():
            return
        left = [runner for runner in self.runners if runner.open is not None]
        for runner in left:
            runner.abort()
        if left and output is not None:
            raise ChainError(f"{left[0]}: its last member never ran in this forward; plan again for this call")


def install(root: nn.Module, chains: Sequence[Chain]) -> Installed:
    """Puts the hooks of ``chains`` on ``root``'s own modules (the caller decides whether ``root`` is
    the user's model or a clone of it).

    Raises:
        ChainError: a member path names no module of ``root``, or a chain's members are not siblings.
    """
    runners = []
    calls: dict[int, _Calls] = {}
    for chain in chains:
        paths = [member_call(name)[0] for name in chain.members]
        members = [_module(root, path) for path in paths]
        if len({path.rpartition(".")[0] for path in paths}) != 1:
            raise ChainError(f"chain {' -> '.join(chain.members)}: members must be children of one module")
        runner = ChainRunner(chain, members, root)
        runners.append(runner)
        for j, (module, name) in enumerate(zip(members, chain.members)):
            calls.setdefault(id(module), _Calls(module)).add(runner, j, member_call(name)[1],
                                                            last=j == len(members) - 1)
    handles = [handle for each in calls.values() for handle in each.register()]
    forwards = [CheckpointedForward(runner) for runner in runners if runner.compiles]
    if forwards:  # what their regions mutate outside (HF's output recorder) must not break the compiled graph
        skip_checkpoint_side_effects_in_backward()
    installed = Installed(root=root, runners=runners, handles=handles, calls=list(calls.values()), forwards=forwards)
    handles.append(root.register_forward_pre_hook(installed._restart, prepend=True))
    handles.append(root.register_forward_hook(installed._closed, always_call=True))
    return installed


class _Calls:
    """The hooks of one module for every chain it is a member of: each call of the module, counted from the start
    of the root's forward, goes to the chains that name that call (``cell#7``) or every call (``cell``)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.every: list[tuple[ChainRunner, int]] = []
        self.at: dict[int, list[tuple[ChainRunner, int]]] = {}
        self.count = 0
        self.running: list[int] = []  # the calls entered and not yet left (a module may call itself)
        self.leaves_last = False

    def add(self, runner: ChainRunner, j: int, call: int | None, *, last: bool) -> None:
        (self.every if call is None else self.at.setdefault(call, [])).append((runner, j))
        self.leaves_last |= last

    def restart(self) -> None:
        self.count = 0
        self.running = []

    def register(self) -> list:
        # a chain's last member leaves the region first among its hooks, and also when its forward raised
        return [self.module.register_forward_pre_hook(self._pre, with_kwargs=True, prepend=True),
                self.module.register_forward_hook(self._post, prepend=self.leaves_last, always_call=self.leaves_last)]

    def _members(self, call: int) -> list[tuple[ChainRunner, int]]:
        return self.every + self.at.get(call, []) if self.at else self.every

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if torch.compiler.is_compiling():  # chains of one call run in their CheckpointedForward
            blocked = [runner for runner, _ in self.every + [r for rs in self.at.values() for r in rs]
                       if not runner.compiles]
            if blocked:
                refuse_compiled(str(blocked[0]))
            return
        call = self.count
        self.count += 1
        self.running.append(call)
        for runner, j in self._members(call):
            runner.pre(j, module, args, kwargs)

    def _post(self, module: nn.Module, args: tuple, output: Any) -> None:
        if torch.compiler.is_compiling():
            return
        call = self.running.pop() if self.running else self.count - 1
        for runner, j in self._members(call):
            runner.post(j, module, args, output)


def _module(root: nn.Module, path: str) -> nn.Module:
    try:
        return root.get_submodule(path)
    except AttributeError as exc:
        raise ChainError(f"the plan names module {path!r}, which {type(root).__name__} does not have; "
                         "apply the plan to the architecture it was made for") from exc
