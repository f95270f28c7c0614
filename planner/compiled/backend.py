"""``torch.compile`` at one ``activation_memory_budget``, with a dynamo cache of its own."""

from __future__ import annotations

import torch
import torch._functorch.config as functorch_config
from torch import nn
from torch._inductor.compile_fx import compile_fx


class BudgetBackend:
    """Inductor with AOTAutograd's ``activation_memory_budget`` set to ``fraction`` while it partitions.

    The partition is made when the forward compiles, so the setting holds for every graph this backend
    compiles (recompilations for new shapes included) and for no other. AOTAutograd's on-disk cache is
    keyed by that setting, so fractions never share an entry."""

    def __init__(self, fraction: float) -> None:
        self.fraction = fraction

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        with functorch_config.patch(activation_memory_budget=self.fraction):
            return compile_fx(gm, example_inputs)


class CompiledModule(nn.Module):
    """``model`` compiled by ``BudgetBackend(fraction)``; parameters and buffers are the model's own.

    ``forward`` enters through a code object made for this instance: dynamo keeps its compiled graphs
    per code object, so compiling the same model at another fraction neither reuses nor evicts these."""

    def __init__(self, model: nn.Module, fraction: float) -> None:
        super().__init__()
        self.model = model
        self.fraction = fraction
        self._compiled = torch.compile(_entry(model), backend=BudgetBackend(fraction))

    def forward(self, *args, **kwargs):
        return self._compiled(*args, **kwargs)


def _entry(model: nn.Module):
    def call(*args, **kwargs):
        return model(*args, **kwargs)

    call.__code__ = call.__code__.replace()  # a fresh code object: its own dynamo cache
    return call
