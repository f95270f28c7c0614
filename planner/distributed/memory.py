"""Planning for one rank of a data-parallel job (FSDP2 or DDP): the per-device memory model.

The profile measures an un-sharded step: full parameters, gradients as autograd creates them,
no optimizer state (the training loop's: ``planner.memory.offset``). ``memory_offset`` turns that
into one rank's memory as a plan-independent per-node offset (added to the simulator's constants):
under FSDP2 parameters and gradients are sharded 1/N, plus the all-gathered parameters of the units
in flight and the reduce-scattered gradients in flight; under DDP the replicas stay whole and the
gradient buckets are added. ``docs/distributed.md`` derives it. ``split_at_units`` cuts segments so
each re-runs at most one FSDP unit: a unit re-run before its own backward stays gathered until then.
What runs inside the job (rank agreement, sharding, counting) is in ``rank.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch import nn

from planner.capture.fsdp_units import resolve_units
from planner.errors import InfeasibleBudget, OptionError
from planner.memory.model import ChunkPlan, MemoryModel
from planner.memory.offset import MemoryOffset
from planner.memory.simulate import simulate
from planner.profiling.memtrack import local_of
from planner.profiling.record import Profile
from planner.solve.deadline import Deadline
from planner.solve.peaks import min_peak
from planner.solve.result import Solution, SolverStatus

PARALLEL = ("fsdp", "ddp")
"""Data-parallel engines a plan can budget for."""
ROOT = ""
"""Unit name of the root module: the parameters outside every named unit."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Distributed:
    """How one rank's memory differs from the profiled un-sharded step."""

    world_size: int
    """Number of ranks N the parameters are sharded over (FSDP) or replicated on (DDP)."""
    parallel: str | None
    """``fsdp`` or ``ddp``."""
    units: tuple[str, ...] = ()
    """Module paths of the FSDP units (``fully_shard`` targets besides the root), in model order."""
    unit_bytes: dict[str, int]
    """Per unit (``""`` for the root): parameter bytes as all-gathered (in the compute dtype), padded to N
    shards."""
    shard_bytes: dict[str, int]
    """Per unit: parameter bytes one rank keeps between steps (its padded shard, in the parameters' own
    dtype; all of them under DDP)."""
    grad_bytes: dict[str, int]
    """Per unit: bytes of the gradients of its trainable parameters, un-sharded, as autograd makes them (in
    the compute dtype): what the profile counts."""
    sharded_grad_bytes: dict[str, int] = field(default_factory=dict)
    """Per unit: the gradient shard one rank keeps after the unit's reduce-scatter (parameters' own dtype)."""
    reduce_bytes: dict[str, int] = field(default_factory=dict)
    """Per unit: the reduce-scatter's input, all of the unit's gradients padded, in the reduce dtype."""
    param_bytes: int
    """All parameters, un-sharded, in the compute dtype, bytes (what the profile counted)."""
    param_dtype: torch.dtype | None = None
    """FSDP2's ``MixedPrecisionPolicy.param_dtype``: what the parameters are gathered and computed in (the
    profile is measured with them cast to it); None: their own dtype."""
    cast_forward_inputs: bool = True
    """Whether floating inputs are cast to ``param_dtype`` too (``MixedPrecisionPolicy.cast_forward_inputs``)."""
    in_pipeline: bool = False
    """Whether the rank runs a pipeline stage's microbatches (``pipeline=``): there every unit stays gathered and
    its gradients un-sharded from its first microbatch to the step's end (``memory_offset``)."""

    @property
    def opaque(self) -> frozenset[str]:
        """Modules to capture as single calls: FSDP2 gathers a unit in its forward's hooks."""
        return frozenset(self.units)


def setup(model: nn.Module, *, world_size: int = 1, parallel: str | None = None,
          units: Sequence[str] | None = None, mixed_precision: Any = None,
          in_pipeline: bool = False) -> Distributed | None:
    """Checks the distributed arguments of ``optimize`` and measures the model's parameters.

    ``mixed_precision``: FSDP2's ``MixedPrecisionPolicy`` (``param_dtype``, ``reduce_dtype``,
    ``cast_forward_inputs``): shards and optimizer state stay in the parameters' dtype, parameters are
    gathered and computed in ``param_dtype``, gradients reduce-scattered in ``reduce_dtype``. ``in_pipeline``:
    the rank runs a pipeline stage (``Distributed.in_pipeline``).

    Returns None for a plain single-device plan (world_size 1, no parallel engine). The optimizer's state is the
    training loop's (``planner.profiling.optimizer``, sharded there).

    Raises:
        OptionError (a ValueError): world_size below 1, an unknown engine, units that name no
            module, or a mixed-precision policy without FSDP.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise OptionError(f"world_size must be an integer >= 1 (the number of ranks), got {world_size!r}")
    if parallel is None and world_size > 1:
        parallel = "fsdp"
    if parallel is not None and parallel not in PARALLEL:
        raise OptionError(f"unknown parallel={parallel!r}: use one of {', '.join(PARALLEL)} "
                          "(ckplan --parallel fsdp|ddp)")
    if units is not None and parallel != "fsdp":
        raise OptionError(f"units= names FSDP units, but parallel is {parallel!r}: pass parallel='fsdp' or drop units")
    if mixed_precision is not None and parallel != "fsdp":
        raise OptionError("mixed_precision= is FSDP2's MixedPrecisionPolicy, but the plan is not for FSDP: pass "
                          "world_size=N (parallel='fsdp') or drop mixed_precision")
    if parallel is None:
        return None
    found = resolve_units(model, units) if parallel == "fsdp" else ()
    n = world_size if parallel == "fsdp" else 1
    param_dtype = getattr(mixed_precision, "param_dtype", None)
    reduce_dtype = getattr(mixed_precision, "reduce_dtype", None)
    sizes: dict[str, dict[str, int]] = {k: dict.fromkeys((ROOT, *found), 0) for k in _SIZES}
    seen, counted = set(), 0
    for name, parameter in model.named_parameters():
        if id(parameter) in seen:
            continue
        seen.add(id(parameter))
        p = local_of(parameter)  # under tensor parallelism, what this rank holds before FSDP shards it
        owner = next((u for u in found if name.startswith(u + ".")), ROOT)
        compute = _size(p, param_dtype)
        padded = _padded(p, n)
        sizes["unit"][owner] += padded * compute
        sizes["shard"][owner] += padded // n * p.element_size()
        counted += p.numel() * compute
        if parameter.requires_grad:
            sizes["grad"][owner] += p.numel() * compute
            sizes["sharded_grad"][owner] += padded // n * p.element_size()
            sizes["reduce"][owner] += padded * _size(p, reduce_dtype or param_dtype)
    return Distributed(world_size=world_size, parallel=parallel, units=found, unit_bytes=sizes["unit"],
                       shard_bytes=sizes["shard"], grad_bytes=sizes["grad"], sharded_grad_bytes=sizes["sharded_grad"],
                       reduce_bytes=sizes["reduce"], param_bytes=counted, param_dtype=param_dtype,
                       cast_forward_inputs=getattr(mixed_precision, "cast_forward_inputs", True),
                       in_pipeline=in_pipeline)


_SIZES = ("unit", "shard", "grad", "sharded_grad", "reduce")
"""The per-unit byte counts ``setup`` sums (``Distributed``'s ``*_bytes`` dicts)."""


def _size(p: torch.Tensor, dtype: torch.dtype | None) -> int:
    """Bytes per element of ``p`` in ``dtype`` (its own when None or when ``p`` is not floating)."""
    if dtype is None or not p.is_floating_point():
        return p.element_size()
    return dtype.itemsize


def _padded(p: torch.Tensor, n: int) -> int:
    """Elements of ``p`` once FSDP2 pads dim 0 to N equal chunks (``numel`` for N = 1 and scalars)."""
    if n == 1 or p.dim() == 0:
        return p.numel()
    return math.ceil(p.shape[0] / n) * n * (p.numel() // max(p.shape[0], 1))


def unit_of_nodes(profile: Profile, units: Sequence[str]) -> list[str]:
    """The FSDP unit each node runs in (``""``: the root's own code)."""
    wanted = set(units)
    out = []
    for i in range(len(profile.nodes)):
        out.append(next((p for p in profile.calls.paths_around(i) if p in wanted), ROOT))
    return out


def memory_offset(profile: Profile, dist: Distributed) -> MemoryOffset:
    """One rank's memory minus the profiled un-sharded step's, per node (docs/distributed.md).

    In a pipeline stage (``Distributed.in_pipeline``) torch.distributed.pipelining runs every microbatch's
    backward with FSDP2's gradient sync and its resharding after backward off, and torchtitan shards with
    ``reshard_after_forward=False``: every unit stays gathered, at every node (``accumulated_grad_bytes`` counts
    the gradients the microbatches add up)."""
    n_nodes = len(profile.nodes)
    resident = sum(dist.shard_bytes.values()) - dist.param_bytes
    if dist.parallel == "fsdp" and dist.in_pipeline:
        every_unit = np.full(n_nodes, resident + sum(dist.unit_bytes.values()), dtype=np.int64)
        return MemoryOffset(fwd_bytes=every_unit, bwd_bytes=every_unit.copy(),
                            param_bytes=profile.param_bytes + resident)
    if dist.parallel != "fsdp":  # DDP: full replicas, and its flat gradient buckets
        extra = resident + (sum(dist.grad_bytes.values()) if dist.parallel == "ddp" else 0)
        return MemoryOffset(fwd_bytes=np.full(n_nodes, extra, dtype=np.int64),
                            bwd_bytes=np.full(n_nodes, extra, dtype=np.int64),
                            param_bytes=profile.param_bytes + resident)
    owner = unit_of_nodes(profile, dist.units)
    gathered, n = dist.unit_bytes, dist.world_size
    first = {u: owner.index(u) for u in dist.units if u in owner}
    last = {u: n_nodes - 1 - owner[::-1].index(u) for u in first}
    order = sorted(first, key=first.__getitem__)
    fwd = np.zeros(n_nodes, dtype=np.int64)
    bwd = np.zeros(n_nodes, dtype=np.int64)
    cast = dist.param_dtype is not None  # an all-gather casts the local shard first: a copy of A(u)/N
    for t, u in enumerate(owner):
        nxt = next((v for v in order if first[v] > t), None)
        prev = next((v for v in reversed(order) if last[v] < t), None)
        fwd[t] = resident + _in_flight(gathered, u, nxt, n if cast else 0)
        done = [v for v in order if first[v] > t]  # units whose backward has finished
        # a finished unit's un-sharded gradients (what the profile holds) are gone; its gradient shard stays,
        # and the latest one's reduce-scatter input is still alive (freed by the next reduce-scatter)
        shrink = sum(dist.grad_bytes[v] - dist.sharded_grad_bytes[v] for v in done)
        in_flight_rs = dist.reduce_bytes[done[0]] if done else 0
        bwd[t] = resident + _in_flight(gathered, u, prev, n if cast else 0) - shrink + in_flight_rs
    return MemoryOffset(fwd_bytes=fwd, bwd_bytes=bwd,
                        param_bytes=profile.param_bytes + resident)


def accumulated_grad_bytes(dist: Distributed) -> int:
    """Bytes of the un-sharded gradients a pipeline stage's microbatches accumulate between reductions: in the
    reduce dtype where it differs from the compute dtype (FSDP2 upcasts each unit's gradient into its
    accumulator), padded as reduce-scattered."""
    return sum(dist.reduce_bytes.values())


def _in_flight(gathered: dict[str, int], unit: str, neighbour: str | None, cast_shards: int = 0) -> int:
    """All-gathered parameter bytes while a node of ``unit`` runs: the root's (never resharded
    before backward), the unit's, and the larger of the unit's all-gather buffer (before copy-out)
    and the neighbour unit being prefetched, with, under mixed precision, the neighbour's local shard
    cast for its all-gather (1/``cast_shards`` of it; 0: no cast)."""
    own = gathered[unit] if unit != ROOT else 0
    coming = gathered[neighbour] if neighbour else 0
    return gathered[ROOT] + own + max(own, coming + (coming // cast_shards if cast_shards else 0))


def split_at_units(memory: MemoryModel, solution: Solution, budget_bytes: int, dist: Distributed,
                   profile: Profile, *, resolve: Callable[[int], Solution] | None = None,
                   deadline: Deadline, attempts: int = 4) -> Solution:
    """Cuts segments between the FSDP units they contain, so a segment re-runs at most one unit.

    A segment re-runs when its backward first unpacks a saved tensor. FSDP2 (torch >= 2.4) does
    not reshard a unit re-run during backward, so a unit re-run before its own backward stays
    gathered from the re-run until its post-backward: the all-gather moves earlier (the count does
    not change), and memory holds one more unit. The memory model counts one such unit (the
    neighbour term of ``_in_flight``), which is what one unit per segment can need.

    Cutting keeps the cut points' tensors, so the cut plan may exceed the budget: then the plan is
    solved again (``resolve(budget)``) for a budget lowered by the excess, up to ``attempts`` times,
    and last the cut smallest-peak plan is tried.

    Raises:
        InfeasibleBudget: no cut plan found fits the budget.
    """
    if not dist.units or not solution.plan:
        return solution
    unit_nodes = unit_of_nodes(profile, dist.units)
    target, tried = budget_bytes, []
    for _ in range(attempts):
        predicted = simulate(memory, _cut(memory, solution.plan, unit_nodes), solution.saves)  # saves stay
        tried.append(predicted)
        if predicted.peak_bytes <= budget_bytes:
            if predicted.plan == solution.plan:
                return solution
            # a plan solved for a lower budget is optimal there only
            status = solution.status if target == budget_bytes else SolverStatus.FEASIBLE
            return replace(solution, plan=predicted.plan, status=status, recompute_us=predicted.recompute_us)
        target -= predicted.peak_bytes - budget_bytes
        resolved: Solution | None
        try:
            resolved = resolve(target) if resolve is not None and target > 0 else None
        except InfeasibleBudget:
            resolved = None
        if resolved is None or not resolved.plan:
            break
        solution = resolved
    smallest = simulate(memory, _cut(memory, min_peak(memory, deadline=deadline), unit_nodes))
    if smallest.peak_bytes <= budget_bytes:
        return Solution(plan=smallest.plan, status=SolverStatus.FEASIBLE, recompute_us=smallest.recompute_us,
                        bound_us=None, solve_time_s=0.0)
    best = min([*tried, smallest], key=lambda t: t.peak_bytes)
    raise InfeasibleBudget(budget_bytes, best.peak_bytes, best.breakdown)


def _cut(memory: MemoryModel, plan: ChunkPlan, unit_nodes: Sequence[str]) -> ChunkPlan:
    """Each segment cut after every chunk holding a unit that another unit follows in the segment
    (ops between two units go with the second; ops after the last unit stay with it). Chunks of one
    unit (a segment inside a decoder layer) are never cut apart."""
    units = [{u for u in unit_nodes[slice(*memory.regions.bounds(k))] if u != ROOT} for k in range(memory.n_chunks)]
    out = []
    for first, stop in plan:
        start = first
        for k in range(first, stop - 1):
            if units[k] and any(units[j] - units[k] for j in range(k + 1, stop)):
                out.append((start, k + 1))
                start = k + 1
        out.append((start, stop))
    return tuple(out)
