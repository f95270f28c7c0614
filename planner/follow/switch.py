"""Runs a plan that follows the batch: a forward pre-hook that puts each training call's group plan on the
module (``planner.follow.family``), planning a group the first time one of its calls is seen.

Choosing the plan is a dictionary lookup on the call's shapes; when the group differs from the last call's,
the chains' hooks are taken off and the group's put on. Calls without gradients or in eval mode (evaluation,
``generate()``) run no checkpoint and switch nothing.
"""

from __future__ import annotations

import torch
from torch import nn

from planner.capture.cache import install_no_cache, training_with_grad
from planner.errors import OptionError
from planner.follow.family import Family
from planner.follow.shapes import Shapes, shaped
from planner.rewrite.chains import Chain, Installed, install
from planner.rewrite.modules import bind, register_plan, remove_plan


class FollowBatch:
    """The forward pre-hook that runs each training call's group plan on the planned module's hooks, with
    ``use_cache`` off while training; ``remove()`` takes all of it off again (``disable``, a new plan)."""

    def __init__(self, root: nn.Module, family: Family, first: Shapes | None) -> None:
        self.root = root
        self.family = family
        self.current: Shapes | None = None
        self.installed: Installed | None = None
        self.planning = False  # a group is being captured from this very module (a plan made in place)
        self.handles = [root.register_forward_pre_hook(self, with_kwargs=True, prepend=True)]
        cache = install_no_cache(root, warn=True)
        if cache is not None:
            self.handles.append(cache)
        if first is not None:
            self._switch(first)

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.planning or not training_with_grad(module):
            return
        values = bind(module, args, kwargs) or {}
        shapes = shaped(values)
        key = self.family.grid.group(shapes)
        if key is None:
            raise OptionError(f"this call's tensor arguments {sorted(shapes)} are not those the plan follows "
                              f"({sorted(self.family.grid.steps)}); plan with a batch like this call's")
        if key != self.current:
            if key not in self.family.groups:
                self._uninstall()  # the group is captured from the model's own forward, without chains
                self.planning = True
                try:
                    self.family.plan_of(key, {k: v for k, v in values.items() if isinstance(v, torch.Tensor)})
                finally:
                    self.planning = False
            self._switch(key)

    def _switch(self, key: Shapes) -> None:
        self._uninstall()
        chains = [Chain(members=s.chain, saved_modules=s.saved_modules, restore_buffers=s.restore_buffers)
                  for s in self.family.groups[key].segments]
        self.installed = install(self.root, chains)
        self.current = key

    def _uninstall(self) -> None:
        if self.installed is not None:
            self.installed.remove()
        self.installed, self.current = None, None

    def remove(self) -> None:
        """Takes the hooks and the current group's chains off the module."""
        self._uninstall()
        for handle in self.handles:
            handle.remove()
        self.handles = []


def follow(root: nn.Module, family: Family, first: Shapes | None) -> FollowBatch:
    """Makes ``root`` run each training call's group plan, replacing any plan installed on it before."""
    remove_plan(root)
    hooks = FollowBatch(root, family, first)
    register_plan(root, hooks)
    return hooks
