"""``torch.compile`` at one ``activation_memory_budget``, with a dynamo cache of its own."""

from __future__ import annotations

import enum
import inspect

import torch
from torch import nn

from planner.capture.cache import cache_owner, training_with_grad
from planner.compat.torch_private import (
    activation_memory_budget,
    checkpoint_side_effects_break_graph,
    compile_fx,
)
from planner.rewrite.modules import break_graph_after


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


class Graphs(enum.Enum):
    """Where dynamo breaks the graph of a compiled plan."""

    ONE = "one"
    """Nowhere: the model in one graph, as it compiles unplanned (ckplan has dynamo trace a checkpointed region that
    mutates state outside it into the graph: ``skip_fwd_side_effects_in_bwd_under_checkpoint``)."""
    INPUTS_APART = "inputs_apart"
    """Once, after the model's input embedding (``get_input_embeddings()``): inductor would fuse its backward into
    the kernel that ends the first layer's backward, allocating its gradient (vocabulary x width) while that
    layer's backward buffers are alive; apart, it runs once they are freed (``docs/compiled.md``)."""
    PER_REGION = "per_region"
    """At each checkpointed region that mutates state outside it (a Hugging Face decoder layer), as torch.compile
    does by default."""


INDUCTOR = "inductor"
"""torch.compile's default backend, the one ``activation_memory_budget`` partitions for."""


class CompiledModule(nn.Module):
    """``model`` compiled by ``BudgetBackend(fraction)`` (``backend`` another torch.compile backend by name, at
    fraction 1.0); parameters and buffers are the model's own.

    ``forward`` enters through a code object made for this instance: dynamo keeps its compiled graphs
    per code object, so compiling the same model at another fraction neither reuses nor evicts these.
    ``Graphs.INPUTS_APART`` puts a forward hook on the model's input embedding (one that only breaks dynamo's
    graph): give it a module of ckplan's own, such as a hook plan's clone, never the user's."""

    def __init__(self, model: nn.Module, fraction: float, *, graphs: Graphs = Graphs.ONE,
                 backend: str = INDUCTOR) -> None:
        if backend != INDUCTOR and fraction != 1.0:
            raise ValueError(f"activation_memory_budget={fraction:g} is inductor's; {backend!r} compiles at 1.0")
        super().__init__()
        self.model = model
        self.fraction = fraction
        self.graphs = graphs
        if graphs is Graphs.INPUTS_APART:
            embedding = input_embedding(model)
            if embedding is None:
                raise ValueError("the model has no input embedding (get_input_embeddings) to compile apart")
            break_graph_after(model, embedding)
        self._compiled = torch.compile(_entry(model),
                                       backend=BudgetBackend(fraction) if backend == INDUCTOR else backend)

    def forward(self, *args, **kwargs):
        if self.graphs is not Graphs.PER_REGION:
            return self._compiled(*args, **kwargs)
        with checkpoint_side_effects_break_graph():
            return self._compiled(*args, **kwargs)


def input_embedding(model: nn.Module) -> nn.Module | None:
    """The model's input embedding (Hugging Face's and PEFT's ``get_input_embeddings()``), or None."""
    get = getattr(model, "get_input_embeddings", None)
    try:
        embedding = get() if callable(get) else None
    except (NotImplementedError, AttributeError):
        return None
    return embedding if isinstance(embedding, nn.Module) else None


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
