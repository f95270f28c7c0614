"""``plan_stages``: every stage of a model split for pipeline parallelism, each planned for the microbatches its
schedule keeps in flight (``pipeline=``, ``planner.memory.pipeline``), under one per-rank budget.

    stages = [first, middle, last]                     # the stage modules, as torchtitan or a manual split makes them
    plans = plan_stages(stages, "60GB", inputs=(microbatch,), pipeline="1f1b:3:8", loss_fn=loss_of_logits)
    stage = PipelineStage(plans[rank].module, rank, len(stages), device)

Each stage's example input is what the stages before it make of the first stage's microbatch (run once, without
gradients; received activations require gradients, as the pipeline's do). A stage before the last is planned with
the sum of its outputs as its loss, a stand-in for the gradient it receives; the last with ``loss_fn``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from typing_extensions import Unpack

from planner.api import optimize
from planner.capture.inputs import as_inputs
from planner.errors import OptionError
from planner.options import OptionArgs, PlanOptions, resolve
from planner.pipeline import UserInputs
from planner.plan import Plan


def plan_stages(stages: Sequence[nn.Module], budget: int | str, *, inputs: UserInputs,
                options: PlanOptions | None = None, **overrides: Unpack[OptionArgs]) -> list[Plan]:
    """One plan per stage module, in pipeline order, each for its place in ``pipeline`` under ``budget``.

    Args:
        stages: the stage modules, first to last (one per pipeline rank: ``pipeline.stages`` of them; a chunk of
            an interleaved rank is planned alone with ``optimize``, ``docs/distributed.md``).
        budget: each rank's budget (``"NN%"``: of each stage's own un-checkpointed peak).
        inputs: one microbatch of the first stage's input.
        options, **overrides: ``PlanOptions`` for every stage, ``pipeline`` among them (``"1f1b:4:8"``: the
            schedule, stages and microbatches); ``loss_fn`` applies to the last.

    Raises:
        OptionError: as many stages as the pipeline has ranks are needed; ``pipeline_rank`` is set by this.
        PlannerError: whatever ``optimize`` raises for a stage (``InfeasibleBudget`` names the stage).
    """
    opts = resolve(options, overrides, where="optimize")
    layout = opts.pipeline
    if layout is None:
        raise OptionError("plan_stages plans a pipeline's stages: give pipeline= (e.g. pipeline='1f1b:4:8')")
    if len(stages) != layout.stages or layout.chunks != 1:
        raise OptionError(f"plan_stages takes one stage module per pipeline rank: {len(stages)} given for "
                          f"{layout.stages} stages of {layout.chunks} chunk(s); plan each chunk of an interleaved rank "
                          f"with optimize(..., pipeline=, pipeline_rank=), its budget less what the rank's other "
                          f"chunks hold (docs/distributed.md)")
    if "pipeline_rank" in overrides:
        raise OptionError("plan_stages sets pipeline_rank for each stage: drop it")
    given: UserInputs = inputs
    plans = []
    for rank, stage in enumerate(stages):
        last = rank == len(stages) - 1
        stage_options = replace(opts, loss_fn=opts.loss_fn if last else None)  # before the last: the outputs' sum
        plans.append(optimize(stage, budget, inputs=given, options=stage_options, pipeline=layout, pipeline_rank=rank))
        if not last:
            example = as_inputs(stage, given)
            given = (_received(stage, example.args, example.kwargs),)
    return plans


def _received(stage: nn.Module, args: tuple, kwargs: dict) -> Any:
    """The next stage's input: this stage's output on the example, detached, requiring gradients as received
    activations do."""
    with torch.no_grad():
        output = stage(*args, **kwargs)
    if not isinstance(output, torch.Tensor):
        raise OptionError(f"plan_stages passes one tensor between stages; {type(stage).__name__} returned "
                          f"{type(output).__name__}: plan each stage with optimize(..., pipeline=, pipeline_rank=)")
    return output.detach().requires_grad_(output.is_floating_point())
