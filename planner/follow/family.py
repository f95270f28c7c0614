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
shapes (``planner.profiling.scaling``). Plans run on the model's own forward (the hook executor), which takes any
shape. Where the device has a host link that runs beside compute, each group's plan chooses its own offloads
(``planner.planning.offloading``), which the switch hands the root's offloader with the group's chains. A group
no plan fits raises ``InfeasibleBudget`` from the training call that needs it.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Hashable, Mapping
from dataclasses import replace
from typing import Any

from torch import nn

from planner.capture.inputs import Inputs, bind
from planner.capture.method import ExecutorKind
from planner.capture.setting import as_trained
from planner.capture.tree import copy_runs_alone, private_copy
from planner.common.log import get_logger
from planner.common.loop import TrainingLoop
from planner.common.units import format_bytes
from planner.distributed.memory import setup
from planner.errors import CaptureError, InfeasibleBudget, OptionError, ProfileError
from planner.follow.groups import GroupPlan, GroupTable
from planner.follow.shapes import ShapeGrid, Shapes, ShapeSpec, fitted, realize, shaped, spread
from planner.memory.simulate import simulate
from planner.options import PlanOptions
from planner.planning.chunkings import solve_prepared
from planner.planning.offloading import host_link, offload_limits, offload_spec, solve_offloaded
from planner.planning.prepared import Prepared, prepared_from
from planner.planning.step import captured_and_profiled
from planner.profiling.record import profile_from_dict, profile_to_dict
from planner.profiling.scaling import Reference, reference_roofline
from planner.rewrite.modules import own_hooks
from planner.rewrite.offload_spec import OffloadSpec
from planner.rewrite.segment import Segment, segments_of
from planner.solve.deadline import Deadline
from planner.solve.result import Solution

LOG = get_logger("follow")

_SAVED_OPTIONS = ("keep_output", "solver", "time_limit_s", "max_chunks", "selective", "must_save", "must_recompute",
                  "world_size", "parallel", "offload")
"""What a saved family plans its new groups with (the loss function is the caller's: ``Plan.apply``; the
optimizer's state as measured is in the saved training loop)."""

class Family:
    """The plans of every group of call shapes seen so far, and how to plan a new group."""

    def __init__(self, *, model: nn.Module | None, options: PlanOptions, loop: TrainingLoop, budget_bytes: int,
                 grid: ShapeGrid, reference: Reference, groups: GroupTable | None = None,
                 example: Mapping[str, Any] | None = None) -> None:
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
        """The example batch's measured profile and its nodes' roofline times, scaled to each group's shape."""
        self.groups = GroupTable(groups or {})
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
        with as_trained(prepared.model, autocast=prepared.loop.autocast_dtype):  # as the example was profiled
            roofline = reference_roofline(prepared.captured, prepared.model, prepared.example, prepared.profile,
                                          loss_fn=options.loss_fn, keep_output=options.keep_output)
        return cls(model=prepared.model, options=options, loop=prepared.loop, budget_bytes=budget_bytes,
                   grid=ShapeGrid.around(shapes), reference=Reference(profile=prepared.profile, roofline=roofline),
                   example=values)

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
                        grid=self.grid, reference=self.reference, example=self.example)
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
                "groups": self.groups.to_json(),
                "reference_profile": profile_to_dict(self.reference.profile),
                "reference_roofline": [[name, f, b] for name, (f, b) in self.reference.roofline.items()]}

    @classmethod
    def from_dict(cls, data: Any) -> Family:
        """The family ``to_dict`` wrote (not bound to a model yet: ``bound``).

        Raises:
            TypeError, ValueError, KeyError: a malformed field (``load_plan`` names the file).
        """
        grid = ShapeGrid(anchors={k: tuple(v) for k, v in data["grid"]["anchors"].items()},
                         steps={k: tuple(v) for k, v in data["grid"]["steps"].items()})
        groups = GroupTable.from_json(data["groups"])
        options = PlanOptions(**{k: v for k, v in data["options"].items() if k in _SAVED_OPTIONS})
        roofline = {str(name): (float(f), float(b)) for name, f, b in data["reference_roofline"]}
        loop = TrainingLoop.from_dict(data.get("loop", {"keep_output": options.keep_output}), "plan.family.loop")
        reference = Reference(profile=profile_from_dict(data["reference_profile"],
                                                        source="plan.family.reference_profile"), roofline=roofline)
        family = cls(model=None, options=options, loop=loop, budget_bytes=int(data["budget_bytes"]), grid=grid,
                     reference=reference, groups=groups)
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

    @property
    def offloads(self) -> bool:
        """Whether its groups' plans may offload activations: as ``offload`` says, by default where the device
        has a host link that runs beside compute (``planner.planning.offloading.offload_limits``)."""
        link = host_link(self.reference.profile)
        return self.options.offload is not False and link is not None and link.overlaps

    def offload(self, key: Hashable) -> OffloadSpec | None:
        """The offloads of the group ``key`` (None: it keeps or re-runs each activation)."""
        group = self.groups.get(key)  # type: ignore[call-overload]
        return group.offload if group is not None else None

    def table(self) -> list[dict[str, Any]]:
        """One row per group planned so far, smallest first (``GroupTable.rows``)."""
        return self.groups.rows()

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
        """``_plan_group``, logged: the group, then how long it took and what it plans (the training call that
        met the group waits for it, so the user sees why)."""
        shapes = ", ".join(f"{name} {tuple(shape)}" for name, shape in key)
        LOG.info("a call of a new shape group (%s): planning it ...", shapes)
        started = time.perf_counter()
        try:
            group = self._plan_group(key, values)
        except BaseException:
            LOG.info("planning the new shape group (%s) failed", shapes)
            raise
        what = f"{len(group.segments)} segments" if group.segments else "no checkpoint (its step fits)"
        LOG.info("planned a new shape group (%s) in %.1f s: %s, predicted peak %s", shapes,
                 time.perf_counter() - started, what, format_bytes(group.predicted_peak_bytes))
        return group

    def prepared(self, key: Shapes, values: Mapping[str, Any]) -> Prepared:
        """The group's step for its upper shapes (from this call's own arguments, its flags too), captured and
        profiled as ``prepare`` does (``planner.planning.step``), on a private copy of the model: memory from a
        meta replay, times the reference's scaled (``planner.profiling.scaling``). Under autocast, which does not
        run on meta tensors, a group no larger than the example's (it fits where the example did) is measured
        instead (profiling puts the random generators back: training draws what it would have,
        ``planner.capture.step.untouched``); a larger one is replayed without autocast's casts
        (``docs/limits.md``).

        Raises:
            OptionError: a family read from a file, not applied to a model yet.
            CaptureError, ProfileError: the step cannot be captured or replayed at the group's shape.
        """
        if self.model is None:
            raise OptionError("this plan was read from a file: apply it to a model (plan.apply(model)) first")
        example = Inputs(args=(), kwargs={name: fitted(value, dict(key).get(name)) for name, value in values.items()})
        model = private_copy(self.model, drop_hooks=own_hooks(self.model))[0]  # never the user's own tree
        measure = self.loop.autocast is not None and self._within_example(key)
        with copy_runs_alone(self.model):
            captured, profile = captured_and_profiled(model, example, self.options, loop=self.loop,
                                                      distributed=self.distributed, runs=ExecutorKind.HOOKS,
                                                      scaled_from=None if measure else self.reference)
        return prepared_from(model, example, captured, profile, options=self.options, loop=self.loop,
                             distributed=self.distributed)

    def _within_example(self, key: Shapes) -> bool:
        """Whether every dim of the group's upper shapes is at most the example's."""
        return all(name in self.grid.anchors and len(shape) == len(self.grid.anchors[name])
                   and all(d <= a for d, a in zip(shape, self.grid.anchors[name])) for name, shape in key)

    def _plan_group(self, key: Shapes, values: Mapping[str, Any]) -> GroupPlan:
        """Plans a new group for its upper shapes, as ``optimize`` plans: ``prepared``, then the solve stage under
        the family's budget."""
        setting = f"calls shaped {', '.join(f'{name} {tuple(shape)}' for name, shape in key)} (a group of the plan " \
                  "that follows the batch)"
        try:
            prepared = self.prepared(key, values)
        except (CaptureError, ProfileError) as exc:  # e.g. a loss_fn bound to the example batch's targets
            raise type(exc)(f"planning {setting}: {exc}; a plan that follows the batch runs the model and loss_fn at "
                            "each group's shape, so a loss_fn holding the example batch's targets cannot follow it "
                            "(a loss computed in forward, as Hugging Face models compute it, can)") from exc
        limits = offload_limits(prepared, self.options)

        def solve_at(budget_bytes: int, deadline: Deadline, selective: bool = True) -> tuple[Prepared, Solution]:
            options = self.options if selective else replace(self.options, selective=False)
            return solve_prepared(prepared, budget_bytes, options, deadline)

        deadline = Deadline.after(self.options.time_limit_s)
        try:
            if limits is None:
                prepared, solution = solve_at(self.budget_bytes, deadline)
            else:  # the group's own offloads, chosen with its plan
                prepared, solution = solve_offloaded(prepared, self.budget_bytes, limits, deadline, solve_at)
        except InfeasibleBudget as exc:
            raise exc.planned_for(setting) from None
        timeline = simulate(prepared.memory, solution.plan, solution.saves, solution.offloads)
        return GroupPlan(shapes=key, segments=segments_of(prepared.profile, prepared.regions, prepared.memory,
                                                          solution.plan, solution.saves),
                         offload=offload_spec(prepared, solution.offloads),
                         predicted_peak_bytes=timeline.peak_bytes, baseline_peak_bytes=prepared.baseline.peak_bytes,
                         recompute_ms=solution.recompute_us / 1000, step_ms=prepared.profile.step_ms)


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
