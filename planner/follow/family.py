"""Plans that follow the batch: each training call runs the plan made for its own shape's group.

Real batches change shape from step to step (dynamic padding, a short last batch, a long tail of lengths).
A ``Family`` groups call shapes on a grid (``planner.follow.shapes.ShapeGrid``: each dim of each tensor argument
rounded up to the next grid line; lines a sixteenth of the example's size apart), plans each group for the group's
largest shape the first time a call of it is seen (or ahead, for the shapes a user names), and keeps that
plan. The family is the chooser of the hook executor's switching plan (``planner.rewrite.switching``): each
training call's group is a dictionary lookup, and the executor re-installs the chains' hooks when the group
changes. A group whose un-checkpointed step fits the budget runs no checkpoint at all.

A group first seen in training is planned there, inside the model's forward pre-hook, on a private copy of
the module tree (``planner.capture.tree.private_copy``: own buffers and gradients, none of ckplan's hooks):
the user's model is never changed, and an error or a Ctrl-C during the planning leaves it as it was.

Each group's memory comes from a meta-tensor replay at its shape (exact, nothing allocated); its times
are the example batch's measured times scaled node by node by the ratio of roofline estimates at the two
shapes (``scaled_profile``). Plans run on the model's own forward (the hook executor), which takes any
shape. A group no plan fits raises ``InfeasibleBudget`` from the training call that needs it.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from torch import nn

from planner.capture.api import capture
from planner.capture.inputs import Inputs, bind
from planner.capture.method import ExecutorKind
from planner.capture.setting import as_trained
from planner.capture.tree import copy_runs_alone, private_copy
from planner.common.checked_json import as_list, check_record, record_from_json
from planner.common.loop import TrainingLoop
from planner.common.units import format_bytes
from planner.distributed.memory import setup
from planner.errors import CaptureError, InfeasibleBudget, OptionError, ProfileError
from planner.follow.shapes import ShapeGrid, Shapes, ShapeSpec, fitted, realize, shaped, spread
from planner.memory.simulate import simulate
from planner.options import PlanOptions
from planner.planning.chunkings import solve_prepared
from planner.planning.prepared import Prepared, prepared_from
from planner.profiling.devices import load_device
from planner.profiling.estimate import Roofline
from planner.profiling.memory_pass import StepTimes, assemble
from planner.profiling.meta import memory_on_meta
from planner.profiling.record import Profile, profile_from_dict, profile_to_dict
from planner.rewrite.modules import own_hooks
from planner.rewrite.segment import Segment, segments_of
from planner.solve.deadline import Deadline

_SAVED_OPTIONS = ("keep_output", "solver", "time_limit_s", "max_chunks", "selective", "must_save", "must_recompute",
                  "world_size", "parallel")
"""What a saved family plans its new groups with (the loss function is the caller's: ``Plan.apply``; the
optimizer's state as measured is in the saved training loop)."""

@dataclass(frozen=True, kw_only=True, slots=True)
class GroupPlan:
    """The plan of one group of call shapes."""

    shapes: Shapes
    """The group's upper shapes: what it was planned for."""
    segments: tuple[Segment, ...]
    """What it checkpoints (chains of module calls); empty when the un-checkpointed step fits."""
    predicted_peak_bytes: int
    baseline_peak_bytes: int
    """Predicted peak of the group's un-checkpointed step."""
    recompute_ms: float
    """Forward time re-run in backward per step, ms (scaled from the example's measured times)."""
    step_ms: float
    """Time of one un-checkpointed step at this shape, ms (scaled likewise)."""


class Family:
    """The plans of every group of call shapes seen so far, and how to plan a new group."""

    def __init__(self, *, model: nn.Module | None, options: PlanOptions, loop: TrainingLoop, budget_bytes: int,
                 grid: ShapeGrid, reference: Profile, reference_roofline: Mapping[str, tuple[float, float]],
                 groups: dict[Shapes, GroupPlan] | None = None, example: Mapping[str, Any] | None = None) -> None:
        self.model = model
        """The model groups are captured and replayed on; None for a family read from a file, until it is
        applied to a model (``bound``)."""
        self.example = example
        """The example call's arguments by name, which shapes planned ahead are made from (``plan_ahead``);
        None for a family read from a file."""
        self.options = replace(options, follow_batch=False, shapes=None, progress=None)
        """What each group is planned with (it is planned once, so it follows nothing itself)."""
        self.loop = loop
        """The training loop every group's step runs in (the optimizer's state, gradients alive...)."""
        self.distributed = None if model is None else setup(model, world_size=self.options.world_size,
                                                            parallel=self.options.parallel)
        """What every group's step holds on a DDP rank besides its own (gradient buckets); None on one device."""
        self.budget_bytes = budget_bytes
        self.grid = grid
        self.reference = reference
        """The example batch's measured profile, whose times are scaled to each group's shape."""
        self.reference_roofline = reference_roofline
        """Per node of the reference: its roofline forward and backward ms at the example's shape."""
        self.groups: dict[Shapes, GroupPlan] = dict(groups or {})
        self.strict = options.follow_batch is not None
        """Whether a group that cannot be planned raises from the training call (``follow_batch=True``); else
        (the default) its calls run the example group's plan, with a warning, as a plan for one shape would."""
        self.unplanned: dict[Shapes, str] = {}
        """Groups that could not be planned (not strict), with why: they run the example group's plan."""
        self.flags_seen = False
        """Whether a call of the example's group with other flags than the example's has been met (its group is
        then planned again, once, for the forward those calls run: ``choose``)."""

    @classmethod
    def around(cls, prepared: Prepared, budget_bytes: int, options: PlanOptions) -> Family:
        """The family of a prepared model's example batch (its group's plan is the caller's to add)."""
        values = bind(prepared.model, prepared.example.args, prepared.example.kwargs) or {}
        shapes = shaped(values)
        if not shapes:
            raise OptionError("follow_batch needs a tensor argument in the example inputs to follow")
        return cls(model=prepared.model, options=options, loop=prepared.loop, budget_bytes=budget_bytes,
                   grid=ShapeGrid.around(shapes),
                   reference=prepared.profile, example=values,
                   reference_roofline=reference_roofline(prepared.captured, prepared.model, prepared.example,
                                                         prepared.profile, options=options, loop=prepared.loop))

    @property
    def example_group(self) -> Shapes:
        """The example batch's group: its upper shapes are the example's own (the grid's lines pass through it)."""
        key = self.grid.group(self.grid.anchors)
        assert key is not None  # the grid is made around the example's shapes
        return key

    def bound(self, model: nn.Module, options: PlanOptions | None = None) -> Family:
        """This family planning its new groups on ``model`` (a family read from a file), with ``options``. The
        groups are shared: one planned on ``model`` shows in this family's ``table()`` and is saved with it."""
        family = Family(model=model, options=options or self.options, loop=self.loop, budget_bytes=self.budget_bytes,
                        grid=self.grid,
                        reference=self.reference, reference_roofline=self.reference_roofline, example=self.example)
        family.groups = self.groups
        family.strict, family.unplanned, family.flags_seen = self.strict, self.unplanned, self.flags_seen
        return family

    def portable(self) -> Family:
        """This family without its model, loss function and example batch, as ``Plan.save`` keeps it: what
        ``plan_on_rank0`` sends to the other ranks, which apply it to their own model with their own ``loss_fn``.
        (Pickled as it is, a family keeps its model: a copy of a planned module plans new groups.)"""
        return Family.from_dict(self.to_dict())

    def to_dict(self) -> dict[str, Any]:
        """The family as JSON (``Plan.save``): its grid, options, every group's plan, and the reference profile
        and roofline new groups are scaled from."""
        opts = self.options
        return {"budget_bytes": self.budget_bytes, "strict": self.strict,
                "grid": {"anchors": {k: list(v) for k, v in self.grid.anchors.items()},
                         "steps": {k: list(v) for k, v in self.grid.steps.items()}},
                "options": {name: list(value) if isinstance(value, tuple) else value
                            for name in _SAVED_OPTIONS for value in [getattr(opts, name)]},
                "loop": self.loop.to_dict(),
                "groups": [{"shapes": [[name, list(shape)] for name, shape in key], "segments":
                            [asdict(s) for s in group.segments], "predicted_peak_bytes": group.predicted_peak_bytes,
                            "baseline_peak_bytes": group.baseline_peak_bytes, "recompute_ms": group.recompute_ms,
                            "step_ms": group.step_ms} for key, group in self.groups.items()],
                "reference_profile": profile_to_dict(self.reference),
                "reference_roofline": [[name, f, b] for name, (f, b) in self.reference_roofline.items()]}

    @classmethod
    def from_dict(cls, data: Any) -> Family:
        """The family ``to_dict`` wrote (not bound to a model yet: ``bound``).

        Raises:
            TypeError, ValueError, KeyError: a malformed field (``load_plan`` names the file).
        """
        grid = ShapeGrid(anchors={k: tuple(v) for k, v in data["grid"]["anchors"].items()},
                         steps={k: tuple(v) for k, v in data["grid"]["steps"].items()})
        groups = {}
        for i, raw in enumerate(as_list(data["groups"], "plan.family.groups")):
            key = tuple((str(name), tuple(shape)) for name, shape in raw["shapes"])
            segments = tuple(record_from_json(Segment, s, f"plan.family.groups[{i}].segments[{j}]")
                             for j, s in enumerate(as_list(raw["segments"], "plan.family.groups.segments")))
            group = record_from_json(GroupPlan, {**raw, "shapes": key, "segments": segments},
                                     f"plan.family.groups[{i}]")
            check_record(group, where=f"plan.family.groups[{i}]")
            groups[key] = group
        options = PlanOptions(**{k: v for k, v in data["options"].items() if k in _SAVED_OPTIONS})
        roofline = {str(name): (float(f), float(b)) for name, f, b in data["reference_roofline"]}
        loop = TrainingLoop.from_dict(data.get("loop", {"keep_output": options.keep_output}), "plan.family.loop")
        family = cls(model=None, options=options, loop=loop, budget_bytes=int(data["budget_bytes"]), grid=grid,
                   reference=profile_from_dict(data["reference_profile"], source="plan.family.reference_profile"),
                   reference_roofline=roofline, groups=groups)
        family.strict = bool(data.get("strict", True))
        return family

    def plan_ahead(self, spec: ShapeSpec) -> list[GroupPlan]:
        """The plans of the groups of calls shaped ``spec`` (``planner.follow.shapes.realize``; a range: every group
        that covers it), each planned now if it is new.

        Raises:
            OptionError: ``spec`` does not fit the example's arguments, or the family has no example (read
                from a file: name the shapes when planning).
            InfeasibleBudget: no plan of a group fits the budget.
        """
        if self.example is None:
            raise OptionError("shapes can be planned ahead only where the plan is made (optimize(..., shapes=...))")
        plans = []
        for shape in spread(spec, self.grid, self.example):
            values = realize(shape, self.example)
            key = self.grid.group(shaped(values))
            assert key is not None  # realised from the example, the arguments are the grid's
            plans.append(self.plan_of(key, values))
        return plans

    def table(self) -> list[dict[str, Any]]:
        """One row per group planned so far, smallest first: its upper shapes, what it checkpoints, its
        predicted peak against its un-checkpointed one, and its recompute as a share of its step."""
        return [{"shapes": dict(group.shapes), "segments": len(group.segments),
                 "predicted_peak_bytes": group.predicted_peak_bytes, "baseline_peak_bytes": group.baseline_peak_bytes,
                 "recompute_ms": group.recompute_ms, "step_ms": group.step_ms,
                 "overhead": group.recompute_ms / group.step_ms if group.step_ms else 0.0}
                for group in sorted(self.groups.values(), key=lambda g: [math.prod(s) for _, s in g.shapes])]

    def choose(self, values: Mapping[str, Any]) -> tuple[Shapes, tuple[Segment, ...]]:
        """The group of a training call with these arguments (by name) and its plan's segments, planned now if
        the group is new (``planner.rewrite.switching.Chooser``).

        Raises (only where the user asked to follow the batch, ``strict``; else the call runs the example group's
        plan, with a warning when its own could not be made):
            OptionError: a tensor argument of the call has another number of dims than the example's.
            InfeasibleBudget: no plan of the new group fits the budget.
            CaptureError, ProfileError: the model cannot be captured or replayed at the group's shape.
        """
        shapes = shaped(values)
        key = self.grid.group(shapes)
        if (key is None and not self.strict) or key in self.unplanned:  # the model's own forward says what is wrong
            return self.example_group, self.groups[self.example_group].segments
        if key is None:
            odd = next(f"{name} {shape}" for name, shape in shapes.items()
                       if name in self.grid.anchors and len(shape) != len(self.grid.anchors[name]))
            raise OptionError(f"this call's {odd} has another number of dims than the example's; plan with a batch "
                              "like this call's")
        try:
            if key == self.example_group and not self.flags_seen and other_flags(values, self.example):
                self.flags_seen = True  # e.g. TRL's fused_lm_head=True: a forward the example did not run
                self.groups[key] = self._announced(key, values)
            return key, self.plan_of(key, values).segments
        except (CaptureError, ProfileError, InfeasibleBudget) as exc:
            if self.strict:
                raise
            self.unplanned[key] = str(exc).splitlines()[0]
            warnings.warn(f"ckplan: calls shaped {', '.join(f'{n} {tuple(s)}' for n, s in key)} run the plan made "
                          f"for the example's shape, as a plan that does not follow the batch would: their own could "
                          f"not be made ({self.unplanned[key]})", stacklevel=2)
            return self.example_group, self.groups[self.example_group].segments

    def plan_of(self, key: Shapes, values: Mapping[str, Any]) -> GroupPlan:
        """The group's plan, planned now (for its upper shapes, from this call's own tensor arguments) if it is
        new."""
        found = self.groups.get(key)
        if found is None:
            found = self.groups[key] = self._announced(key, values)
        return found

    def _announced(self, key: Shapes, values: Mapping[str, Any]) -> GroupPlan:
        """``_plan_group`` with one progress line on stderr: the group, then how long it took and what it plans
        (the training call that met the group waits for it, so the user sees why)."""
        shapes = ", ".join(f"{name} {tuple(shape)}" for name, shape in key)
        print(f"ckplan: planning a new shape group ({shapes}) ...", end="", file=sys.stderr, flush=True)
        started = time.perf_counter()
        try:
            group = self._plan_group(key, values)
        except BaseException:
            print(" failed", file=sys.stderr, flush=True)
            raise
        what = f"{len(group.segments)} segments" if group.segments else "no checkpoint (its step fits)"
        print(f" {time.perf_counter() - started:.1f} s: {what}, predicted peak "
              f"{format_bytes(group.predicted_peak_bytes)}", file=sys.stderr, flush=True)
        return group

    def _plan_group(self, key: Shapes, values: Mapping[str, Any]) -> GroupPlan:
        """Plans a new group for its upper shapes, as ``optimize`` plans: capture, memory from a meta replay,
        the reference's times scaled (``scaled_profile``), the solve stage under the family's budget."""
        if self.model is None:
            raise OptionError("this plan was read from a file: apply it to a model (plan.apply(model)) first")
        example = Inputs(args=(), kwargs={name: fitted(value, dict(key).get(name))  # the call's flags too:
                                          for name, value in values.items()})
        # its forward as training runs it (TRL's fused_lm_head=True, a custom autograd.Function: capture.aten)
        setting = f"calls shaped {', '.join(f'{name} {tuple(shape)}' for name, shape in key)} (a group of the plan " \
                  "that follows the batch)"
        model = private_copy(self.model, drop_hooks=own_hooks(self.model))[0]  # never the user's own tree
        try:
            with as_trained(model, autocast=self.loop.autocast_dtype), copy_runs_alone(self.model):
                captured = capture(model, example, runs=ExecutorKind.HOOKS)
                profile = scaled_profile(captured, model, example, self.reference, self.reference_roofline,
                                         options=self.options)
        except (CaptureError, ProfileError) as exc:  # e.g. a loss_fn bound to the example batch's targets
            raise type(exc)(f"planning {setting}: {exc}; a plan that follows the batch runs the model and loss_fn at "
                             "each group's shape, so a loss_fn holding the example batch's targets cannot follow it "
                             "(a loss computed in forward, as Hugging Face models compute it, can)") from exc
        prepared = prepared_from(model, example, captured, profile, options=self.options, loop=self.loop,
                                 distributed=self.distributed)
        try:
            prepared, solution = solve_prepared(prepared, self.budget_bytes, self.options,
                                                Deadline.after(self.options.time_limit_s))
        except InfeasibleBudget as exc:
            raise exc.planned_for(setting) from None
        timeline = simulate(prepared.memory, solution.plan, solution.saves)
        return GroupPlan(shapes=key, segments=segments_of(prepared.profile, prepared.regions, prepared.memory,
                                                          solution.plan, solution.saves),
                         predicted_peak_bytes=timeline.peak_bytes, baseline_peak_bytes=prepared.baseline.peak_bytes,
                         recompute_ms=solution.recompute_us / 1000, step_ms=profile.step_ms)


def other_flags(values: Mapping[str, Any], example: Mapping[str, Any] | None) -> dict[str, Any]:
    """The call's flags (plain values that choose what the forward runs: ``fused_lm_head=True``) that the
    example did not pass alike; ``use_cache=False`` is how every step is planned (``as_trained``), and None is
    an argument left out."""
    if example is None:
        return {}
    plain = (bool, int, float, str)
    return {name: value for name, value in values.items()
            if isinstance(value, plain) and not (name == "use_cache" and value is False)
            and (name not in example or example[name] != value)}


def roofline_of(device: str) -> Roofline:
    """The roofline whose ratios scale times on ``device``: a GPU's spec for CUDA, the generic CPU's else."""
    return Roofline(load_device("h100" if device.startswith("cuda") else "generic-cpu"))


def node_roofline(profile: Profile, replayed: Any) -> dict[str, tuple[float, float]]:
    """Per node of ``profile``: the roofline forward and backward ms a meta replay recorded (``MemoryRecorder``)."""
    return {profile.nodes[i].name: (replayed.est_fwd_ms[i], replayed.est_bwd_ms[i])
            for i in range(len(profile.nodes))}


def reference_roofline(captured: Any, model: nn.Module, example: Inputs, profile: Profile, *,
                       options: PlanOptions, loop: TrainingLoop) -> dict[str, tuple[float, float]]:
    """The roofline times of the example batch's nodes, to scale its measured times from."""
    with as_trained(model, autocast=loop.autocast_dtype):  # as the example was profiled
        replay = memory_on_meta(captured, model, example, loss_fn=options.loss_fn, keep_output=options.keep_output,
                                op_ms=roofline_of(profile.device).op_ms, eager=False)
    return node_roofline(profile, replay.recorder)


def scaled_profile(captured: Any, model: nn.Module, example: Inputs, reference: Profile,
                   roofline: Mapping[str, tuple[float, float]], *, options: PlanOptions) -> Profile:
    """The profile at ``example``'s shape: memory from a meta replay (exact), times the reference's measured
    ones scaled per node by the ratio of roofline estimates at the two shapes. A node the reference does not
    have (another code path at this shape) takes its roofline time times the median measured-to-roofline
    ratio of the reference's nodes."""
    replay = memory_on_meta(captured, model, example, loss_fn=options.loss_fn, keep_output=options.keep_output,
                            op_ms=roofline_of(reference.device).op_ms)  # with the model's own forward's locals
    recorder = replay.recorder
    measured = {node.name: (node.fwd_ms, node.bwd_ms) for node in reference.nodes}
    ratios = [measured[name][0] / est[0] for name, est in roofline.items() if name in measured and est[0] > 0]
    usual = statistics.median(ratios) if ratios else 1.0
    fwd: list[float] = []
    bwd: list[float] = []
    for i, record in enumerate(recorder.records):
        now = (recorder.est_fwd_ms[i], recorder.est_bwd_ms[i])
        then, times = roofline.get(record["name"]), measured.get(record["name"])
        for k, out in ((0, fwd), (1, bwd)):
            if then is not None and times is not None and then[k] > 0:
                out.append(times[k] * now[k] / then[k])
            else:
                out.append(now[k] * usual)
    scale = (sum(fwd) + sum(bwd)) / max(1e-9, sum(n.fwd_ms + n.bwd_ms for n in reference.nodes))
    times_ms = StepTimes(fwd_ms=fwd, bwd_ms=bwd, step_fwd_ms=reference.step_fwd_ms * scale,
                         step_bwd_ms=reference.step_bwd_ms * scale,
                         checkpoint_overhead_ms=reference.checkpoint_overhead_ms, sac_op_us=reference.sac_op_us)
    return assemble(recorder, captured, model, replay.example, times=times_ms, excess=replay.excess,
                    device=reference.device)


