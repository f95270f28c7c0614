"""What each rank of a ``torch.distributed`` job does with a plan: agree on it, shard, count, measure.

Ranks that recompute different segments issue different FSDP collectives and hang, and
timings (hence optimal plans) differ from rank to rank. ``plan_on_rank0`` therefore plans
once, on one rank, broadcasts the plan (its segments' node names; never the module) with
``broadcast_object_list``, and every other rank rewrites its own model locally from it.
"""

from __future__ import annotations

import contextlib
import pickle
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from typing_extensions import Unpack

from planner.api import optimize
from planner.capture.fsdp_units import resolve_units
from planner.distributed.tensor import tensor_parallel_degree
from planner.errors import InfeasibleBudget, PlannerError
from planner.options import OptionArgs, PlanOptions, resolve
from planner.pipeline import plan_for, prepare
from planner.plan import Plan
from planner.profiling.allocator import AllocatorTrace

COLLECTIVES = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor",
               "all_reduce")
"""``torch.distributed`` functions ``count_collectives`` counts (FSDP2 calls the first and third)."""


def plan_on_rank0(model: nn.Module, budget: int | str, *, src: int = 0, group: dist.ProcessGroup | None = None,
                  inputs: Any = None, options: PlanOptions | None = None, **overrides: Unpack[OptionArgs]) -> Plan:
    """``optimize()``'s plan made on rank ``src`` only; every rank gets the same plan and its own planned module.

    Call it on every rank, before sharding, with the same arguments and an identical model
    (built from the same seed or checkpoint). Takes ``optimize``'s arguments (``inputs``, ``options`` and
    any ``PlanOptions`` field as a keyword); ``world_size`` defaults to the group's size over the model's
    tensor-parallel degree (the data-parallel ranks). A planning error on ``src`` is raised on every rank, so
    no rank waits forever.

    A model the user parallelised with ``parallelize_module`` (its parameters are DTensors) runs collectives in
    every forward: every rank then profiles it together (the same steps, so the collectives pair up), rank
    ``src`` solves from its own profile, and the others apply its plan.

    Example:
        >>> plan = plan_on_rank0(model, "60%", inputs=(x,), loss_fn=loss_fn)   # doctest: +SKIP
        >>> for block in plan.module.blocks: fully_shard(block)                 # doctest: +SKIP
        >>> fully_shard(plan.module)                                             # doctest: +SKIP
    """
    opts = resolve(options, overrides, where="plan_on_rank0")
    if not dist.is_initialized():
        raise RuntimeError("plan_on_rank0 needs torch.distributed: call dist.init_process_group(...) first, "
                           "or use planner.optimize on a single process")
    tp = tensor_parallel_degree(model)
    if "world_size" not in overrides and (options is None or options.world_size == 1):
        opts = replace(opts, world_size=max(1, dist.get_world_size(group) // tp))
    payload: list[Any] = [None]
    plan = None
    prepared = _prepare_together(model, inputs, opts, group) if tp > 1 else None
    if dist.get_rank() == src:
        try:
            plan = (optimize(model, budget, inputs=inputs, options=opts) if prepared is None
                    else plan_for(prepared, budget, options=opts))
            payload[0] = ("plan", replace(plan, module=None,  # nor the model, through a family that follows the batch
                                          family=plan.family.portable() if plan.family is not None else None))
        except Exception as exc:
            payload[0] = ("error", _portable(exc))
    dist.broadcast_object_list(payload, src=src, group=group)
    kind, value = payload[0]
    if kind == "error":
        cls, args = value
        raise cls(*args)
    if plan is not None:
        return plan
    return replace(value, module=value.apply(model, inputs=inputs, units=opts.units, loss_fn=opts.loss_fn))


def _prepare_together(model: nn.Module, inputs: Any, options: PlanOptions, group: dist.ProcessGroup | None) -> Any:
    """``prepare`` on every rank at once (a tensor-parallel model's profile runs its collectives), the error of
    any rank raised on every rank."""
    prepared, error = None, None
    try:
        prepared = prepare(model, inputs=inputs, options=options)
    except Exception as exc:
        error = _portable(exc)
    errors: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        cls, args = first
        raise cls(*args)
    return prepared


def _portable(exc: Exception) -> tuple:
    """How to raise ``exc`` again on another rank: ``(class, constructor args)``."""
    if isinstance(exc, InfeasibleBudget):  # its args are the message, not the constructor's
        return InfeasibleBudget, (exc.budget_bytes, exc.min_peak_bytes, exc.breakdown, exc.reason)
    try:
        pickle.loads(pickle.dumps(exc))
        return type(exc), exc.args
    except Exception:
        return PlannerError, (f"{type(exc).__name__}: {exc}",)


def apply_plan(plan: Plan, model: nn.Module, *, units: Sequence[str] | None = None, inputs: Any = None) -> nn.Module:
    """``plan.apply(model, units=units, inputs=inputs)``: a plan made for FSDP (units captured as calls)
    rebuilt on ``model`` with the units it was made with (``Plan.apply`` takes ``loss_fn=`` too, for a plan
    that follows the batch).

    Raises:
        PlanMismatch (a ValueError): ``model`` does not trace to the graph the plan was made for.
    """
    return plan.apply(model, inputs=inputs, units=units)


def fully_shard_units(module: nn.Module, units: Sequence[str] | None = None, **fully_shard_kwargs: Any) -> nn.Module:
    """Applies FSDP2's ``fully_shard`` to each unit (default the repeated blocks), then the root,
    as torchtitan does; returns the root. Pass the same ``units`` the plan was made with."""
    from torch.distributed.fsdp import fully_shard

    for path in resolve_units(module, units):
        fully_shard(module.get_submodule(path), **fully_shard_kwargs)
    fully_shard(module, **fully_shard_kwargs)  # in place: the module's class becomes FSDP<its class>
    return module


@contextlib.contextmanager
def count_collectives() -> Iterator[Counter]:
    """Counts calls of ``torch.distributed`` collectives (``COLLECTIVES``) made from Python, by name.

    FSDP2 issues one ``all_gather_single`` per unit it unshards and one ``reduce_scatter_single``
    per unit it reduces. DDP's all-reduces run inside its C++ reducer and are not counted.
    """
    counts: Counter = Counter()
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def counting(name: str, fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    for name, fn in originals.items():
        setattr(dist, name, counting(name, fn))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def resident_bytes(*holders: Any) -> int:
    """Bytes of the distinct storages behind the tensors in ``holders`` (modules: parameters,
    gradients and buffers; optimizers: their state; tensors, tuples, lists and dicts of them),
    counting one rank's local shard of a DTensor."""
    seen: dict[int, int] = {}

    def add(t: Any) -> None:
        if isinstance(t, torch.Tensor):
            local = getattr(t, "_local_tensor", t)
            seen[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
            if t.grad is not None:
                add(t.grad)
        elif isinstance(t, nn.Module):
            for x in [*t.parameters(), *t.buffers()]:
                add(x)
        elif isinstance(t, torch.optim.Optimizer):
            for state in t.state.values():
                add(state)
        elif isinstance(t, dict):
            for x in t.values():
                add(x)
        elif isinstance(t, (list, tuple)):
            for x in t:
                add(x)

    for holder in holders:
        add(holder)
    return sum(seen.values())


def rank_peak_bytes(step: Callable[[], Any], resident: int, *, device: torch.device | str = "cpu") -> int:
    """One rank's peak bytes during ``step()`` (a training step), read at the allocator as ``measure_peak`` reads
    it (``planner.profiling.allocator.AllocatorTrace``: on a CPU torch.profiler's memory events, on CUDA the
    caching allocator's counters): ``resident`` (the bytes alive before it, from ``resident_bytes``) plus the
    highest rise of what the allocator holds while it runs. That counts what a storage counter misses (FSDP2
    resizes storages in place, DDP's reducer and gloo's collectives allocate in C++) and leaves out what is not
    the device's memory (an offloader's host store, made under ``uncounted``)."""
    with AllocatorTrace(device) as trace:
        step()
    return resident + trace.peak_bytes


def same_on_all_ranks(value: Any, group: dist.ProcessGroup | None = None) -> bool:
    """True when every rank holds an equal ``value`` (e.g. the node names of a plan's segments)."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, value, group=group)
    return all(v == gathered[0] for v in gathered)
