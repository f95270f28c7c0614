"""A model captured and profiled once (``Prepared``), and its cost model at a chosen chunking."""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import nn

from planner.capture.api import Captured
from planner.capture.inputs import Inputs
from planner.distributed.memory import Distributed, memory_offset
from planner.memory.model import MemoryModel, build_model
from planner.memory.regions import Regions, find_regions
from planner.memory.simulate import Timeline, simulate
from planner.profiling.devices import SacCost
from planner.profiling.record import Profile


@dataclass(frozen=True, kw_only=True, slots=True)
class Prepared:
    """A model captured and profiled once, ready to be planned for any budget."""

    model: nn.Module
    example: Inputs
    """The example call the model was captured and profiled with."""
    captured: Captured
    profile: Profile
    regions: Regions
    memory: MemoryModel
    baseline: Timeline
    """Predicted memory without checkpointing."""
    sac_cost: SacCost
    """SAC's per-op cost in ``memory`` and where it comes from (profile, device spec or default)."""
    distributed: Distributed | None = None
    """One rank of a data-parallel job (``world_size``, ``parallel``...), or None for one device."""



def chunked(prepared: Prepared, max_chunks: int) -> Prepared:
    """``prepared`` with its regions (at most ``max_chunks`` chunks) and the cost model over them."""
    measured, dist = prepared.profile, prepared.distributed
    regions = find_regions(measured, max_chunks=max_chunks,      # where segments may start and end:
                           modules=prepared.captured.method.runs_modules)  # chains of module calls for hooks
    memory = build_model(measured, regions,                      # the cost model the solver optimises
                         offset=dist and memory_offset(measured, dist),  # one rank's share of the job
                         sac_op_us=prepared.sac_cost.op_us)
    return replace(prepared, regions=regions, memory=memory, baseline=simulate(memory, ()))
