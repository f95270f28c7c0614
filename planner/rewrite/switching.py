"""Plans that change with the training call: a forward pre-hook asks a ``Chooser`` which plan this call runs,
and puts that plan's chains on the module when it differs from the last call's.

A plan that follows the batch (``planner.follow``) is a chooser: it looks the call's shapes up in its groups
and plans a new group on first sight; each group's plan may offload activations of its own, which the switch
hands the root's ``Offloader`` with the group's chains. The hook is the hook executor's (``HookExecutor.build``
and ``apply`` install it); the chooser only answers with segments and offloads, so every chain is installed
here, by the executor.
Calls without gradients or in eval mode (evaluation, ``generate()``) run no checkpoint and switch nothing.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from planner.capture.cache import install_no_cache, training_with_grad
from planner.capture.inputs import bind
from planner.rewrite.chain_hooks import Installed, install
from planner.rewrite.chains import Chain
from planner.rewrite.offload import Offloader, install_offloads, offloader_of
from planner.rewrite.offload_spec import OffloadSpec
from planner.rewrite.segment import Segment


class Chooser(Protocol):
    """What a switching plan asks on every training call."""

    @property
    def example_group(self) -> Hashable:
        """The key of the example call's plan, which the executor installs first."""
        ...

    def choose(self, values: Mapping[str, Any]) -> tuple[Hashable, Sequence[Segment]]:
        """The plan for a call with these arguments (by parameter name): a key naming it (calls with equal
        keys run one plan) and its segments. May plan it now; raises for a call it cannot plan."""
        ...

    @property
    def offloads(self) -> bool:
        """Whether its plans may offload activations (``offload`` then says which, per plan)."""
        ...

    def offload(self, key: Hashable) -> OffloadSpec | None:
        """The offloads of the plan ``key`` names (None: it offloads nothing)."""
        ...


class Switching:
    """The forward pre-hook that runs each training call's plan on ``root``'s own modules, with ``use_cache``
    off while training; ``remove()`` takes all of it off again."""

    def __init__(self, root: nn.Module, chooser: Chooser, first: tuple[Hashable, Sequence[Segment]] | None) -> None:
        self.root = root
        self.chooser = chooser
        self.current: Hashable | None = None
        self.segments: tuple[Segment, ...] = ()
        """The segments of the plan installed now (``current``'s)."""
        self.installed: Installed | None = None
        self.handles = [root.register_forward_pre_hook(self, with_kwargs=True, prepend=True)]
        cache = install_no_cache(root, warn=True)
        if cache is not None:
            self.handles.append(cache)
        self.offloader: Offloader | None = None
        """The offloads of the plan installed now, switched with it; None when no plan of the chooser offloads.
        Its hooks run after this one, so that a call's forward offloads what its own plan says."""
        if chooser.offloads:
            installed = install_offloads(root, None, switched=True)
            assert installed is not None  # switched: always installed
            self.offloader, handles = installed
            self.handles += handles
        if first is not None:
            self._switch(*first)

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if torch.compiler.is_compiling():  # the choice is Python dynamo cannot trace: it runs outside the graph,
            return _chosen_eagerly(self, module, args, kwargs)  # and a new plan's forwards fail dynamo's guards
        self.choose(module, args, kwargs)

    def choose(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Installs the plan of this call (nothing for a call without gradients)."""
        if not training_with_grad(module):
            return
        key, segments = self.chooser.choose(bind(module, args, kwargs) or {})
        if key != self.current or tuple(segments) != self.segments:  # a group planned again keeps its key
            self._switch(key, segments)

    def _switch(self, key: Hashable, segments: Sequence[Segment]) -> None:
        self._uninstall()
        self.installed = install(self.root, [Chain.of(s) for s in segments])
        self.current, self.segments = key, tuple(segments)
        if self.offloader is not None:
            self.offloader.use(self.chooser.offload(key))

    def _uninstall(self) -> None:
        if self.installed is not None:
            self.installed.remove()
        self.installed, self.current, self.segments = None, None, ()

    def hook_ids(self) -> frozenset[int]:
        """Ids of every hook this plan has on the module tree now (``planner.capture.tree.private_copy``
        leaves them out of copies it runs)."""
        mine = frozenset(handle.id for handle in self.handles)
        return mine | (self.installed.hook_ids() if self.installed is not None else frozenset())

    def remove(self) -> None:
        """Takes the hook and the current plan's chains off the module."""
        self._uninstall()
        for handle in self.handles:
            handle.remove()
        self.handles = []
        if self.offloader is not None and offloader_of(self.root) is self.offloader:
            del self.root._ckplan_offloader
        self.offloader = None


@torch.compiler.disable
def _chosen_eagerly(switching: Switching, module: nn.Module, args: tuple, kwargs: dict) -> None:
    """``Switching.choose`` in compiled code: run eagerly, one graph break where each call picks its plan."""
    switching.choose(module, args, kwargs)
