"""A model captured and profiled once (``Prepared``), and its cost model at a chosen chunking."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import nn

from planner.capture.api import Captured
from planner.capture.inputs import Inputs
from planner.common.loop import TrainingLoop
from planner.distributed.memory import Distributed, memory_offset
from planner.errors import BudgetError
from planner.memory.build import build_model
from planner.memory.model import MemoryModel
from planner.memory.offset import combined, fused_loss, loop_offset
from planner.memory.regions import Regions, find_regions
from planner.memory.rules import SegmentRules
from planner.memory.simulate import Timeline, simulate
from planner.options import PlanOptions
from planner.profiling.devices import SacCost, load_device, sac_op_cost, spec_for
from planner.profiling.fitting import resident_bytes
from planner.profiling.headroom import capacity_bytes, spec_capacity_bytes
from planner.profiling.record import Profile
from planner.rewrite.executor import Executor, executor_for


@dataclass(frozen=True, kw_only=True, slots=True)
class Chunked:
    """A prepared model's cost model at one chunking."""

    regions: Regions
    memory: MemoryModel
    baseline: Timeline
    """Predicted memory without checkpointing."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StageRoom:
    """What a pipeline stage's solves count beyond one microbatch's step (``planner.planning.pipelined``): the
    gradients its microbatches accumulate, alive throughout, and at the forward's end ``end_bytes`` more, so that
    a plan fits only if what its forward keeps leaves room for the copies the other microbatches in flight hold."""

    accumulated_bytes: int
    """The accumulated gradients' bytes."""
    end_bytes: int = 0
    """Bytes added to the last forward node's constant."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Prepared:
    """A model captured and profiled once, ready to be planned for any budget."""

    model: nn.Module
    example: Inputs
    """The example call the model was captured and profiled with."""
    options: PlanOptions
    """The options it was prepared with (``loss_fn``, ``device``, ``world_size``... are fixed from here on)."""
    captured: Captured
    profile: Profile
    executor: Executor
    """How its plans run (``planner.rewrite.executor``)."""
    rules: SegmentRules
    """What that executor allows, as the memory model and the solvers read it."""
    sac_cost: SacCost
    """SAC's per-op cost in ``memory`` and where it comes from (profile, device spec or default)."""
    distributed: Distributed | None = None
    """One rank of a data-parallel job (``world_size``, ``parallel``...), or None for one device."""
    loop: TrainingLoop
    """The training loop around the step: what it keeps alive besides the step's own tensors."""
    chunks: Chunked
    """The cost model at the chunking searched first (``chunked`` gives others)."""
    compiled_loss: bool = False
    """Whether the cost model counts the loss as inductor runs it (``for_compiled_loss``)."""
    stage: StageRoom | None = None
    """Set while a pipeline stage is solved: what its cost model counts beyond the step (``StageRoom``)."""

    @property
    def regions(self) -> Regions:
        return self.chunks.regions

    @property
    def memory(self) -> MemoryModel:
        return self.chunks.memory

    @property
    def baseline(self) -> Timeline:
        return self.chunks.baseline


def cost_model(profile: Profile, rules: SegmentRules, *, max_chunks: int | None, sac: SacCost,
               distributed: Distributed | None, loop: TrainingLoop, compiled_loss: bool = False,
               stage: StageRoom | None = None) -> Chunked:
    """The regions (at most ``max_chunks`` chunks) of ``profile`` and the cost model over them; ``compiled_loss``:
    the loss counted as inductor runs it (``planner.memory.offset.fused_loss``); ``stage``: a pipeline stage's
    room (``StageRoom``)."""
    regions = find_regions(profile, max_chunks=max_chunks, rules=rules)  # where segments may start and end
    return _over(profile, regions, sac=sac, distributed=distributed, loop=loop, compiled_loss=compiled_loss,
                 stage=stage)


def _over(profile: Profile, regions: Regions, *, sac: SacCost, distributed: Distributed | None, loop: TrainingLoop,
          compiled_loss: bool, stage: StageRoom | None) -> Chunked:
    """The cost model over ``regions`` (``cost_model``)."""
    has_bwd = np.array([node.bwd_peak_bytes is not None for node in profile.nodes], dtype=bool)
    rank = memory_offset(profile, distributed) if distributed is not None else None  # one rank's share of a job
    accumulated = stage.accumulated_bytes if stage is not None else None
    offset = combined(loop_offset(profile, loop, accumulated_bytes=accumulated), rank, has_bwd)  # and the loop's
    if compiled_loss:
        offset = fused_loss(profile, offset)
    if stage is not None and stage.end_bytes and len(profile.nodes):
        fwd = offset.fwd_bytes.copy()
        fwd[-1] += stage.end_bytes
        offset = replace(offset, fwd_bytes=fwd)
    memory = build_model(profile, regions, offset=offset,                # the cost model the solver optimises
                         sac_op_us=sac.op_us, sac_host_us=sac.host_us)
    return Chunked(regions=regions, memory=memory, baseline=simulate(memory, ()))


def chunked(prepared: Prepared, max_chunks: int | None) -> Prepared:
    """``prepared`` with its cost model at ``max_chunks`` chunks."""
    return over_regions(prepared, find_regions(prepared.profile, max_chunks=max_chunks, rules=prepared.rules))


def over_regions(prepared: Prepared, regions: Regions) -> Prepared:
    """``prepared`` with its cost model over ``regions`` (another chunking of the same profile), as its fields say
    (a pipeline stage's room, ``Prepared.stage``, among them)."""
    return replace(prepared, chunks=_over(prepared.profile, regions, sac=prepared.sac_cost,
                                          distributed=prepared.distributed, loop=prepared.loop,
                                          compiled_loss=prepared.compiled_loss, stage=prepared.stage))


def for_compiled_loss(prepared: Prepared) -> Prepared:
    """``prepared`` with its loss counted as inductor runs it (``planner.memory.offset.fused_loss``), at the same
    chunking: the cost model a compiled step's plans are searched with."""
    return chunked(replace(prepared, compiled_loss=True), prepared.options.max_chunks)


def prepared_from(model: nn.Module, example: Inputs, captured: Captured, profile: Profile, *, options: PlanOptions,
                  loop: TrainingLoop, distributed: Distributed | None = None) -> Prepared:
    """The ``Prepared`` of a model already captured and profiled: its executor and rules, its cost model."""
    sac = sac_op_cost(profile, spec_for(profile, options.device))  # from the profile or the device spec, never
    # from this machine
    executor = executor_for(captured.method)  # how the plan will run, and so what it allows
    rules = executor.rules(captured, profile, units=distributed.units if distributed else (),
                           compilable=options.compilable)
    return Prepared(model=model, example=example, options=options, captured=captured, profile=profile,
                    executor=executor, rules=rules, sac_cost=sac, distributed=distributed, loop=loop,
                    chunks=cost_model(profile, rules, max_chunks=options.max_chunks, sac=sac,
                                      distributed=distributed, loop=loop))


def device_bytes(prepared: Prepared) -> int:
    """What the device ``prepared`` was profiled for can hold for one training step (``budget="device"``): a
    device spec's memory, or what the device here can still allocate plus what the step's tensors hold already
    (``planner.profiling.headroom``), each less a reserve for what plans do not count.

    Raises:
        BudgetError: the device is not here (a profile made elsewhere), or how much it holds cannot be told."""
    profile = prepared.profile
    if profile.estimated_for:
        spec = load_device(profile.estimated_for)
        return spec_capacity_bytes(spec.memory_bytes, gpu=spec.kind == "gpu")
    device = torch.device(profile.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BudgetError(f"the profile was measured on {device}, which this machine does not have, so a 'device' "
                          "budget means nothing here; give the budget in bytes or plan for a device spec")
    return capacity_bytes(device, held_bytes=resident_bytes(prepared.model, prepared.example))
