"""The one way a training step is captured and profiled: ``prepare``, ``profile``, ``enable``, ``plan_on_rank0``
and each shape group of a plan that follows the batch all go through ``captured_and_profiled``."""

from __future__ import annotations

from torch import nn

from planner.capture.api import Captured, capture
from planner.capture.inputs import Inputs
from planner.capture.method import ExecutorKind
from planner.capture.setting import as_trained
from planner.common.interrupt import kept_ctrl_c
from planner.common.loop import TrainingLoop
from planner.distributed.memory import Distributed
from planner.options import PlanOptions
from planner.profiling.api import capture_inputs, profile_for
from planner.profiling.record import Profile
from planner.profiling.scaling import Reference


def captured_and_profiled(model: nn.Module, example: Inputs, opts: PlanOptions, *, loop: TrainingLoop,
                          distributed: Distributed | None = None, budget: int | str | None = None,
                          runs: ExecutorKind | None = None, scaled_from: Reference | None = None,
                          ) -> tuple[Captured, Profile]:
    """``model``'s step on ``example``, captured and profiled as a planned model trains
    (``planner.capture.setting.as_trained``: under the loop's autocast, in the dtype FSDP2 computes in).

    ``runs``: how the plan must run (a plan that follows the batch always runs by hooks); ``budget`` bounds the
    pieces of a step profiled in pieces; ``scaled_from``: the example's profile, which a shape group's times are
    scaled from instead of being measured (``planner.profiling.scaling``)."""
    stage = opts.progress or (lambda name: None)
    dtype = distributed.param_dtype if distributed else None
    with kept_ctrl_c(), as_trained(model, autocast=loop.autocast_dtype, param_dtype=dtype):
        stage("capture")
        step_inputs = example.cast(dtype) if distributed and distributed.cast_forward_inputs else example
        captured = capture(model, capture_inputs(model, step_inputs),  # graph + module calls (meta inputs for a
                           units=distributed.opaque if distributed else frozenset(),  # meta model); under FSDP,
                           whole_units=not opts.selective,                             # whole units are calls
                           runs=ExecutorKind.HOOKS if opts.follow_batch or scaled_from else runs)
        stage("profile")
        measured = profile_for(captured, model, step_inputs, loss_fn=opts.loss_fn,  # one real step node by node,
                               device=opts.device, saved=opts.profile,              # or a saved, estimated or
                               keep_output=opts.keep_output or opts.pipeline is not None,  # scaled profile; in
                               budget=budget, scaled_from=scaled_from)  # pieces if it does not fit here; a pipeline
    return captured, measured  # stage's schedule holds each microbatch's output until its backward
