"""``load_plan``: a plan saved by ``Plan.save`` read back, every field checked, nothing executed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from planner.capture.method import CaptureMethod
from planner.common.checked_json import (
    INT_LIMIT,
    UNIT_LIMITS,
    as_list,
    as_tuple,
    check_record,
    read_json,
    record_from_json,
)
from planner.compiled.backend import Graphs
from planner.errors import PlanFileError
from planner.follow.family import Family
from planner.memory.breakdown import PeakBreakdown
from planner.memory.caching import ReservedPeak
from planner.memory.pipeline import StagePeak
from planner.plan import FORMAT, VERSION, CompiledStep, MemoryTimeline, Plan
from planner.profiling.devices import SacCostSource
from planner.rewrite.offload_spec import OffloadSpec
from planner.rewrite.segment import Segment
from planner.solve.result import SolverStatus


def load_plan(path: str | Path) -> Plan:
    """Reads a plan written by ``Plan.save``; call ``.apply(model)`` to get the module.

    The file is plain JSON and is never executed; every field is checked against its type, fields this
    version does not know are ignored (newer optional fields).

    Raises:
        PlanFileError (a ValueError): the file cannot be read, is not a ckplan plan, is of an unknown
            version, or has a missing or malformed field; the message names the file and the field.
    """
    try:
        data = read_json(path)
    except OSError as exc:
        raise PlanFileError(f"cannot read plan {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise PlanFileError(f"{path} is not a ckplan plan: {exc}; pass a file written by Plan.save") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise PlanFileError(f"{path} is not a ckplan plan; pass a file written by Plan.save")
    if data.get("version") != VERSION:
        raise PlanFileError(f"{path} has plan version {data.get('version')!r}, this ckplan reads version {VERSION}: "
                            "plan the model again with this version")
    try:
        plan = _plan_from_dict(data)
        check_record(plan, where="plan", limits=_AMOUNTS, signed=("freed_bytes",))
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
        what = f"lacks the field {exc.args[0]!r}" if isinstance(exc, KeyError) else f"is malformed ({exc})"
        raise PlanFileError(f"{path} {what}; the file is incomplete or was edited: plan the model again") from None
    return plan


_AMOUNTS = dict.fromkeys(UNIT_LIMITS, INT_LIMIT)
"""A plan's amounts are reported, not computed with: any int64 (a budget of 10**18 bytes plans and saves)."""


def _plan_from_dict(data: dict[str, Any]) -> Plan:
    """The ``Plan`` (without its module) of ``to_dict``'s dict; lists become tuples, unknown keys are ignored."""
    segments = tuple(record_from_json(Segment, s, f"plan.segments[{i}]")
                     for i, s in enumerate(as_list(data["segments"], "plan.segments")))
    largest = tuple(as_tuple(item) for item in as_list(data.get("largest_kept", []), "plan.largest_kept"))
    timeline = data.get("timeline")
    if timeline is not None:
        timeline = record_from_json(MemoryTimeline, timeline, "plan.timeline")
    planned = data.get("planned_inputs") or {}
    planned = {k: as_tuple(v) for k, v in planned.items()} if isinstance(planned, dict) else planned
    values = {**data, "module": None, "segments": segments, "largest_kept": largest, "timeline": timeline,
              "planned_inputs": planned}
    family = data.get("family")
    values["family"] = None if family is None else Family.from_dict(family)
    reserved = data.get("reserved")
    values["reserved"] = None if reserved is None else record_from_json(ReservedPeak, reserved, "plan.reserved")
    offload = data.get("offload")
    if offload is not None:
        values["offload"] = OffloadSpec.from_dict(offload, "plan.offload")
    stage = data.get("pipeline_stage")
    if stage is not None:
        values["pipeline_stage"] = record_from_json(StagePeak, stage, "plan.pipeline_stage")
    compiled = data.get("compiled_step")
    if compiled is not None:
        values["compiled_step"] = record_from_json(CompiledStep, compiled, "plan.compiled_step",
                                                   convert={"graphs": Graphs})
    return record_from_json(Plan, values, "plan", convert={
        "solver_status": SolverStatus, "capture_method": CaptureMethod, "sac_cost_source": SacCostSource,
        "peak_breakdown": PeakBreakdown.from_dict})
