"""``torch.compile`` at one ``activation_memory_budget``, with a dynamo cache of its own."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from planner.capture.cache import cache_owner, training_with_grad
from planner.compat.torch_private import activation_memory_budget, checkpoint_side_effects_break_graph, compile_fx


class BudgetBackend:
    """Inductor with AOTAutograd's ``activation_memory_budget`` set to ``fraction`` while it partitions.

    The partition is made when the forward compiles, so the setting holds for every graph this backend
    compiles (recompilations for new shapes included) and for no other. AOTAutograd's on-disk cache is
    keyed by that setting, so fractions never share an entry."""

    def __init__(self, fraction: float) -> None:
        self.fraction = fraction

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        with activation_memory_budget(self.fraction):
            return compile_fx(gm, example_inputs)


class CompiledModule(nn.Module):
    """``model`` compiled by ``BudgetBackend(fraction)``; parameters and buffers are the model's own.

    ``forward`` enters through a code object made for this instance: dynamo keeps its compiled graphs
    per code object, so compiling the same model at another fraction neither reuses nor evicts these."""

    def __init__(self, model: nn.Module, fraction: float, *, one_graph: bool = True) -> None:
        super().__init__()
        self.model = model
        self.fraction = fraction
        self.one_graph = one_graph
        """False: a checkpointed region whose forward mutates state outside it (a Hugging Face decoder layer) breaks
        the graph, as torch.compile does by default, where ckplan has dynamo trace it into one graph."""
        self._compiled = torch.compile(_entry(model), backend=BudgetBackend(fraction))

    def forward(self, *args, **kwargs):
        if self.one_graph:
            return self._compiled(*args, **kwargs)
        with checkpoint_side_effects_break_graph():
            return self._compiled(*args, **kwargs)


def _entry(model: nn.Module):
    """``model(...)``, with ``use_cache=False`` in training calls of a model that has a key/value cache
    (Hugging Face; as its gradient checkpointing and ckplan's eager plans do: ``capture/cache.py``)."""
    no_cache = cache_owner(model) is not None and _takes_keyword(model, "use_cache")

    def call(*args, **kwargs):
        if no_cache and training_with_grad(model):
            kwargs = {**kwargs, "use_cache": False}
        return model(*args, **kwargs)

    call.__code__ = call.__code__.replace()  # a fresh code object: its own dynamo cache
    return call


def _takes_keyword(model: nn.Module, name: str) -> bool:
    """Whether ``model.forward`` accepts ``name=`` (by name, or through ``**kwargs``, as a PEFT root does)."""
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
