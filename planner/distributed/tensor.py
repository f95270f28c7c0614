"""Planning one rank of a tensor-parallel job from the model's config, before any process exists (meta).

A rank of a Megatron-style tensor-parallel job runs each decoder layer with 1/N of the attention heads and of
the MLP's width: column-parallel q/k/v/gate/up projections, row-parallel o/down projections (a Hugging Face
config's ``base_model_tp_plan``), the norms, the embeddings and the head replicated. ``local_model`` builds
that rank's model on the meta device from the config, so that the meta replay counts exactly its local
parameters and activations. ``with_collectives`` adds what the plan's all-reduces cost, which the local model
does not run: in forward each row-parallel output is all-reduced (a second buffer of it while that runs), in
backward each column-parallel input's gradient; each takes ``2 (N - 1) / N`` times its bytes over the device's
interconnect. A segment that re-runs a row-parallel projection re-runs its all-reduce too.

For a model already parallelised with ``parallelize_module`` (DTensor parameters), plan on the ranks themselves
(``planner.distributed.rank.plan_on_rank0``): its profile measures all of this.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import torch
from torch import nn

from planner.common.patterns import matches
from planner.errors import OptionError
from planner.profiling.devices import DeviceSpec
from planner.profiling.memtrack import dtensor_class
from planner.profiling.record import Profile

SPLIT = ("num_attention_heads", "num_key_value_heads", "intermediate_size")
"""Config fields a rank holds 1/N of."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorPlan:
    """Which modules a tensor-parallel job splits, and over how many ranks."""

    degree: int
    """Ranks each layer is split over (N)."""
    colwise: tuple[str, ...]
    """Module path patterns of the column-parallel projections (``model.layers.*.self_attn.q_proj``)."""
    rowwise: tuple[str, ...]
    """Module path patterns of the row-parallel projections (``model.layers.*.mlp.down_proj``)."""


def local_model(model: nn.Module, degree: int) -> tuple[nn.Module, TensorPlan]:
    """One rank's share of ``model`` under tensor parallelism over ``degree`` ranks, built on the meta device from
    its Hugging Face config (heads and MLP width divided by ``degree``, the head size kept), and the plan it
    follows (the config's ``base_model_tp_plan``). The module tree and its paths are the model's own, so a plan
    made for it applies to the parallelised model.

    Raises:
        OptionError: the model has no Hugging Face config with a ``base_model_tp_plan``, or ``degree`` does not
            divide its heads, key/value heads or MLP width.
    """
    config = getattr(model, "config", None)
    layout = getattr(config, "base_model_tp_plan", None)
    if not layout:
        raise OptionError(f"tensor_parallel= plans one rank from a Hugging Face config's base_model_tp_plan, which "
                          f"{type(model).__name__} has not: parallelise the model with parallelize_module and plan "
                          "it on its ranks with planner.distributed.plan_on_rank0")
    assert config is not None  # it has a plan
    local = copy.deepcopy(config)
    for name in SPLIT:
        value = getattr(config, name, None)
        if not isinstance(value, int) or value % degree:
            raise OptionError(f"tensor_parallel={degree} does not divide the model's {name} ({value}): use a "
                              "degree that divides its heads, key/value heads and MLP width")
        setattr(local, name, value // degree)
    local.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dtype = next((p.dtype for p in model.parameters()), torch.float32)
    with torch.device("meta"):
        rank = type(model)(local).to(dtype)
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and not isinstance(getattr(model, prefix, None), nn.Module):
        prefix = ""  # the base model itself: the plan's paths are its own

    def paths(style: str) -> tuple[str, ...]:
        return tuple(f"{prefix}.{key}" if prefix else key for key, value in layout.items() if value == style)

    return rank, TensorPlan(degree=degree, colwise=paths("colwise"), rowwise=paths("rowwise"))


def with_collectives(profile: Profile, plan: TensorPlan, spec: DeviceSpec | None) -> Profile:
    """``profile`` (a rank's local model) with the all-reduces tensor parallelism adds: at the last node of each
    row-parallel call, its output once more at the forward's peak and the all-reduce's time in its forward; at
    each column-parallel call's node that reads the layer's input, the input's gradient once more at its
    backward's peak and the all-reduce's time in its backward. Times are 0 without ``spec``'s interconnect."""
    nodes = list(profile.nodes)
    link = spec.interconnect_gb_per_s if spec is not None else None

    def ms(nbytes: int) -> float:
        return 0.0 if not link else 2 * (plan.degree - 1) / plan.degree * nbytes / (link * 1e9) * 1e3

    added_fwd = added_bwd = 0.0
    for call in profile.calls.calls:
        path = call.path
        if any(matches(p, path) for p in plan.rowwise):
            out = max((profile.storages[s].nbytes for s in nodes[call.last].outputs), default=0)
            node = nodes[call.last]
            nodes[call.last] = replace(node, fwd_peak_bytes=node.fwd_peak_bytes + out, fwd_ms=node.fwd_ms + ms(out))
            added_fwd += ms(out)
        elif any(matches(p, path) for p in plan.colwise):
            reads = [(max((profile.storages[s].nbytes for s in nodes[i].inputs), default=0), i)
                     for i in range(call.first, call.last + 1)]
            size, i = max(reads)
            node = nodes[i]
            if node.bwd_peak_bytes is not None:
                nodes[i] = replace(node, bwd_peak_bytes=node.bwd_peak_bytes + size, bwd_ms=node.bwd_ms + ms(size))
                added_bwd += ms(size)
    return replace(profile, nodes=tuple(nodes), step_fwd_ms=profile.step_fwd_ms + added_fwd,
                   step_bwd_ms=profile.step_bwd_ms + added_bwd)


def tensor_parallel_degree(model: nn.Module) -> int:
    """How many ranks share each of ``model``'s parameters by tensor parallelism: the largest device mesh of a
    DTensor parameter (1 when none is one)."""
    dtensor = dtensor_class()
    if dtensor is None:
        return 1
    return max((p.device_mesh.size() for p in model.parameters() if isinstance(p, dtensor)), default=1)
