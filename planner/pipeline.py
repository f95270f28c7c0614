"""The pipeline, stage after stage, and nothing else: ``prepare`` (capture and profile once) and ``plan_for`` (solve
and rewrite per budget), the two halves ``optimize`` (``planner.api``) runs; ``profile`` the first half's result
alone."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from typing_extensions import Unpack

from planner.capture.inputs import as_inputs, bind, tensor_shapes
from planner.capture.method import ExecutorKind
from planner.capture.setting import ambient_autocast
from planner.common.budget import BudgetBounds, is_device_budget, parse_budget
from planner.distributed.memory import setup, split_at_units
from planner.distributed.tensor import local_model, tensor_parallel_degree, with_collectives
from planner.errors import InfeasibleBudget, OptionError
from planner.follow.family import Family
from planner.follow.groups import GroupPlan
from planner.follow.shapes import ShapeGrid, realize, shaped, spread
from planner.memory.model import MemoryModel
from planner.memory.offload import Offloads, relief
from planner.memory.simulate import Timeline, simulate
from planner.options import PREPARED, OptionArgs, PlanOptions, resolve
from planner.plan import MemoryTimeline, Plan
from planner.planning.chunkings import save_options_for, solve_budget, solve_prepared
from planner.planning.offloading import offload_limits, offload_spec, solve_offloaded
from planner.planning.pipelined import held_by_stage, received_gradient, solve_pipelined, unplanned_stage_peak
from planner.planning.prepared import Prepared, chunked, device_bytes, prepared_from
from planner.planning.reserve import reserve_predicted, reserved_for, within_reserve
from planner.planning.step import captured_and_profiled
from planner.profiling.api import step_device_type
from planner.profiling.devices import load_device
from planner.profiling.optimizer import optimizer_state
from planner.profiling.record import Profile
from planner.rewrite.modules import PlannedShapes
from planner.rewrite.offload import install_offloads
from planner.rewrite.offload_spec import OffloadSpec
from planner.rewrite.segment import Segment, segments_of
from planner.solve.deadline import Deadline
from planner.solve.registry import capabilities
from planner.solve.result import Solution

UserInputs = tuple | Mapping | torch.Tensor | None
"""What ``inputs=`` takes: positional arguments (a tuple), keyword arguments (a dict) or one tensor."""



def check_shapes(options: PlanOptions, values: Mapping[str, Any]) -> None:
    """Refuses, before any work, a shape to plan ahead that the example call (``values``, its arguments by
    name) cannot be made into, or a range that covers too many groups.

    Raises:
        OptionError: naming the shape.
    """
    if not options.shapes:
        return
    grid = ShapeGrid.around(shaped(values))
    for spec in options.shapes:
        for shape in spread(spec, grid, values):
            realize(shape, values)


def prepare(model: nn.Module, *, inputs: UserInputs = None, options: PlanOptions | None = None,
            budget: int | str | None = None, runs: ExecutorKind | None = None,
            **overrides: Unpack[OptionArgs]) -> Prepared:
    """Captures and profiles ``model`` once (arguments as for ``optimize``).

    A step that does not fit whole in what the device has left is profiled in pieces (memory from shapes,
    times measured piece by piece, ``planner.profiling.fitting``); ``budget``, the budget the plans will be
    made for, then bounds the pieces too, so that profiling holds no more than the plan will. ``runs``: how the
    plan must run, whatever torch.fx can trace (``ExecutorKind.HOOKS``: the model's own forward, for ``enable``);
    a plan that follows the batch always runs by hooks."""
    opts = resolve(options, overrides, where="prepare")
    example = as_inputs(model, inputs)
    tensor = None
    if opts.tensor_parallel > 1:  # one rank's share of every layer, on meta: what that rank holds and computes
        if opts.device is None:
            raise OptionError("tensor_parallel= estimates one rank from the model's config on the meta device: pass "
                              "device= (a device spec such as 'h100'), or plan a model you parallelised on its "
                              "ranks with plan_on_rank0")
        model, tensor = local_model(model, opts.tensor_parallel)
    dist = setup(model, world_size=opts.world_size, parallel=opts.parallel, units=opts.units,
                 mixed_precision=opts.mixed_precision, in_pipeline=opts.pipeline is not None)
    check_shapes(opts, bind(model, example.args, example.kwargs) or {})
    shards = dist.world_size if dist is not None and dist.parallel == "fsdp" else 1
    loop = opts.loop(optimizer=optimizer_state(opts.optimizer, model, device_type=step_device_type(model, opts.device),
                                               shards=shards),  # what the loop holds besides the step
                     autocast=opts.autocast or ambient_autocast(model))
    captured, measured = captured_and_profiled(model, example, opts, loop=loop, distributed=dist, budget=budget,
                                               runs=runs)
    if tensor is not None:  # the all-reduces the local model does not run
        assert opts.device is not None  # refused above without a device spec
        measured = with_collectives(measured, tensor, load_device(opts.device))
    return prepared_from(model, example, captured, measured, options=opts, loop=loop, distributed=dist)


def profile(model: nn.Module, *, inputs: UserInputs = None, options: PlanOptions | None = None,
            **overrides: Unpack[OptionArgs]) -> Profile:
    """Profiles one training step of ``model``: what each node costs in time and memory.

    Args:
        model: the model (left as it was found).
        inputs: positional (tuple) or keyword (dict) arguments; default ``model.example_inputs``.
        options, **overrides: the ``PlanOptions`` a profile depends on: ``loss_fn``, ``keep_output`` (the loop
            keeps the output referenced through backward), ``device`` (None, or the device the model is on, to
            measure a real step there; the name of a device spec, ``"h100"``, see ``planner.device_names()``,
            or a spec file to estimate the step for that device from meta tensors and a roofline, allocating
            nothing; a model on the meta device needs a spec), ``progress``. The others plan and are refused.

    Returns:
        The ``Profile``; ``prof.save(path)`` writes it, ``load_profile(path)`` reads it back and
        ``optimize(model, budget, inputs=..., profile=prof)`` plans from it without profiling.

    Example:
        >>> prof = profile(model, inputs=(x,), device="h100")      # doctest: +SKIP
        >>> prof.save("profiles/mymodel-h100.json")                 # doctest: +SKIP
    """
    opts = resolve(options, overrides, where="profile")
    loop = opts.loop(optimizer=None, autocast=opts.autocast or ambient_autocast(model))
    return captured_and_profiled(model, as_inputs(model, inputs), opts, loop=loop)[1]


def plan_for(prepared: Prepared, budget: int | str, *, options: PlanOptions | None = None,
             target: nn.Module | None = None, **overrides: Unpack[OptionArgs]) -> Plan:
    """Solves and rewrites a prepared model for one budget (arguments as for ``optimize``, over the
    options the model was prepared with; ``target`` as for ``plan_from_solution``).

    When no plan over the prepared chunks fits and the graph has more cut positions, the chunks are
    made finer (twice as many, up to ``WIDEST_CHUNKS``) until a plan fits; ``InfeasibleBudget`` then
    says whether infeasibility is proven over every cut position or only over those tried
    (``max_chunks``). All of it shares ``time_limit_s``: a finer chunking is not searched once it has
    run out (``InfeasibleBudget``, not proven), and ``OutOfTime`` when no plan was found at all.

    Raises:
        OptionError: an option fixed when the model was prepared (``planner.options.PREPARED``) differs.
    """
    opts = resolve(options or prepared.options, overrides, where="plan_for")
    changed = [name for name in PREPARED if getattr(opts, name) != getattr(prepared.options, name)]
    if changed:
        raise OptionError(f"{changed[0]}= is fixed when the model is prepared; prepare it again with it "
                          f"(planner.prepare(model, {changed[0]}=...))")
    if opts.pipeline is not None and not prepared.profile.keep_output:
        raise OptionError("a pipeline stage's schedule holds each microbatch's output until its backward, which this "
                          "profile (keep_output=False) does not count: prepare the stage with pipeline= too")
    dist = prepared.distributed
    if dist is not None and dist.in_pipeline != (opts.pipeline is not None):  # units gathered through the stage
        prepared = chunked(replace(prepared, distributed=replace(dist, in_pipeline=not dist.in_pipeline)),
                           opts.max_chunks)
    elif opts.max_chunks != prepared.options.max_chunks:
        prepared = chunked(prepared, opts.max_chunks)
    if opts.pipeline is not None:  # its output's gradient received dense
        prepared = received_gradient(prepared, opts.pipeline, opts.pipeline_rank)
    stage = opts.progress or (lambda name: None)
    baseline_bytes = (prepared.baseline.peak_bytes if opts.pipeline is None  # a stage's "NN%" is of the stage's
                      else unplanned_stage_peak(prepared, opts.pipeline, opts.pipeline_rank))
    budget_bytes = parse_budget(budget, baseline_peak_bytes=baseline_bytes,
                                device_bytes=device_bytes(prepared) if is_device_budget(budget) else None)
    stage("solve")
    started = time.perf_counter()
    deadline = Deadline.after(opts.time_limit_s)  # one limit for every solve below, not one each
    following = follows(prepared, opts)
    reads_budget = capabilities(opts.solver).reads_budget
    limits = offload_limits(prepared, opts) if reads_budget else None

    def solve_at(budget_bytes: int, deadline: Deadline, selective: bool = True,
                 on: Prepared = prepared, explain: bool = True) -> tuple[Prepared, Solution]:
        options = opts if selective else replace(opts, selective=False)
        solved, solution = solve_prepared(on, budget_bytes, options, deadline, explain=explain)
        memory, baseline = solved.memory, solved.baseline
        if (solved.distributed is not None and not solved.distributed.in_pipeline
                and not solution.interrupted):  # FSDP: one unit per segment
            solution = split_at_units(
                memory, solution, budget_bytes, solved.distributed, solved.profile, deadline=deadline,
                resolve=lambda b: solve_budget(opts.solver, memory, b, baseline.peak_bytes, deadline,
                                               save_options_for(solved, options)))
        return solved, solution

    def solved(target_bytes: int) -> tuple[Prepared, Solution]:
        try:
            if limits is None:
                return solve_at(target_bytes, deadline)
            return solve_offloaded(prepared, target_bytes, limits, deadline, solve_at)
        except InfeasibleBudget as exc:
            setting = _setting(prepared)
            if not setting:
                raise
            raise exc.planned_for(setting) from None

    def built(pair: tuple[Prepared, Solution], on: nn.Module | None) -> Plan:
        solution = replace(pair[1], solve_time_s=time.perf_counter() - started)  # the whole stage, widening included
        return plan_from_solution(pair[0], solution, budget_bytes, target=on, follow=opts if following else None)

    if opts.pipeline is not None:  # one microbatch's step, with room for those the schedule keeps in flight
        pair = solve_pipelined(prepared, budget_bytes, opts.pipeline, opts.pipeline_rank, baseline_bytes, limits,
                               lambda room, target, within: solve_at(target, within, on=room, explain=False),
                               deadline)
        stage("rewrite")
        return replace(built(pair, target), pipeline_stage=held_by_stage(prepared, pair, opts.pipeline,
                                                                         opts.pipeline_rank, baseline_bytes))
    pair = solved(budget_bytes)
    stage("rewrite")
    if (opts.budget_bounds is not BudgetBounds.RESERVED or not reserve_predicted(prepared)
            or not reads_budget):  # a fixed placement is what it is at any target
        return built(pair, target)

    solutions: dict[int, tuple[Prepared, Solution]] = {}  # probes are built on clones, the plan kept on ``target``

    def replan(target_bytes: int) -> Plan:
        solution = solved(target_bytes)
        probe = built(solution, None)
        solutions[id(probe)] = solution
        return probe

    first = built(pair, None)
    solutions[id(first)] = pair
    plan = within_reserve(first, budget_bytes, replan)
    return plan if target is None else built(solutions[id(plan)], target)


def follows(prepared: Prepared, options: PlanOptions) -> bool:
    """Whether the plan follows the batch: as ``follow_batch`` says; when it is None, wherever that costs the
    plan nothing and cannot go wrong: the plan already runs by module hooks (the model's own forward: Hugging
    Face models, ``enable``), its loss is the model's own output (no ``loss_fn``: one holding the example
    batch's targets cannot run at another shape), its ranks (if any) are DDP's (not FSDP's, nor tensor-parallel
    ones, which must all run one plan), and the example has a tensor argument to follow."""
    if options.follow_batch is not None:
        return options.follow_batch
    return (prepared.executor.kind is ExecutorKind.HOOKS and options.loss_fn is None and not options.sharded
            and options.tensor_parallel == 1 and tensor_parallel_degree(prepared.model) == 1
            and bool(shaped(bind(prepared.model, prepared.example.args, prepared.example.kwargs) or {})))


def _family(prepared: Prepared, segments: tuple[Segment, ...], offload: OffloadSpec | None, predicted: Timeline,
            solution: Solution, budget_bytes: int, options: PlanOptions) -> Family:
    """The family of a plan that follows the batch: ``segments`` and ``offload`` (predicted ``predicted``) for the
    example's group, and the groups of the shapes ``options`` names, planned now (``planner.follow.family``)."""
    if prepared.executor.kind is not ExecutorKind.HOOKS:
        raise OptionError("follow_batch runs the model's own forward: prepare the model with follow_batch=True")
    family = Family.around(prepared, budget_bytes, options)
    key = family.example_group
    family.groups[key] = GroupPlan(shapes=key, segments=segments, offload=offload,
                                   predicted_peak_bytes=predicted.peak_bytes,
                                   baseline_peak_bytes=prepared.baseline.peak_bytes,
                                   recompute_ms=solution.recompute_us / 1000,
                                   step_ms=prepared.profile.step_ms)
    for spec in options.shapes or ():
        family.plan_ahead(spec)
    return family


def plan_from_solution(prepared: Prepared, solution: Solution, budget_bytes: int, *,
                       target: nn.Module | None = None, follow: PlanOptions | None = None) -> Plan:
    """The Plan (planned module included) for any strategy's solution of a prepared model.

    ``target``: for plans that run the model's own forward, the module tree to put the hooks on
    (``enable`` passes the model itself); default a clone of the model (``planner.capture.tree.clone_tree``).
    ``follow``: the options of a plan that follows the batch, whose example group this solution is.
    """
    memory, baseline = prepared.memory, prepared.baseline
    segments = segments_of(prepared.profile, prepared.regions, memory, solution.plan, solution.saves)
    predicted = simulate(memory, solution.plan, solution.saves, solution.offloads)
    offload = offload_spec(prepared, solution.offloads)
    shapes = tensor_shapes(prepared.model, prepared.example.args, prepared.example.kwargs)
    planned = PlannedShapes(shapes=shapes, predicted_peak_bytes=predicted.peak_bytes,
                            fixed_bytes=predicted.breakdown.parameters_bytes, budget_bytes=budget_bytes)
    family = None if follow is None else _family(prepared, segments, offload, predicted, solution, budget_bytes,
                                                 follow)
    built = prepared.executor.build(prepared.model, prepared.captured, segments, target=target, planned=planned,
                                    follow=family)
    reserved = reserved_for(prepared, built.module, predicted.peak_bytes)  # before the offloads: meta tensors have no
    if family is None:                                                   # host copies; see planning/reserve.py
        install_offloads(built.module, offload)  # (a family's switch runs each group's own)
    return Plan(
        module=built.module,
        budget_bytes=budget_bytes,
        predicted_peak_bytes=predicted.peak_bytes,
        baseline_peak_bytes=baseline.peak_bytes,
        predicted_overhead=(solution.recompute_us + solution.offloads.exposed_us) / memory.step_us,
        recompute_ms=solution.recompute_us / 1000,
        step_ms=prepared.profile.step_ms,
        segments=segments,
        offload=offload,
        reserved=reserved,
        solver_status=solution.status,
        solve_time_s=solution.solve_time_s,
        recompute_bound_ms=(None if solution.bound_us is None  # nothing proven
                            else min(solution.bound_us, solution.recompute_us) / 1000),
        chunks=prepared.regions.n_chunks if prepared.regions.capped else None,
        fingerprint=prepared.captured.fingerprint,
        capture_method=prepared.captured.method,
        capture_notes=prepared.captured.notes,
        device=prepared.profile.device,
        source=built.source,
        peak_breakdown=predicted.breakdown,
        largest_kept=predicted.largest_kept,
        keep_output=prepared.profile.keep_output,
        counted=prepared.loop.counted(),
        profile_pieces=prepared.profile.pieces,
        profile_peak_bytes=prepared.profile.profile_peak_bytes,
        planned_inputs=shapes,
        family=family,
        sac_op_us=prepared.sac_cost.op_us,
        sac_cost_source=prepared.sac_cost.source,
        timeline=MemoryTimeline(
            nodes=memory.node_names,
            forward_bytes=tuple(int(b) for b in predicted.fwd_bytes),
            backward_bytes=tuple(int(b) if ok else None for b, ok in zip(predicted.bwd_bytes, memory.has_bwd)),
            baseline_forward_bytes=tuple(int(b) for b in baseline.fwd_bytes),
            baseline_backward_bytes=tuple(int(b) if ok else None for b, ok in zip(baseline.bwd_bytes, memory.has_bwd)),
            **_offloaded_timeline(memory, solution.offloads),
        ),
    )


def _offloaded_timeline(memory: MemoryModel, offloads: Offloads) -> dict[str, tuple]:
    """The timeline's bytes kept off the device by ``offloads``, per node (none when it offloads nothing)."""
    if not offloads.n:
        return {}
    fwd, bwd = relief(memory, offloads)
    return {"offloaded_forward_bytes": tuple(int(b) for b in fwd),
            "offloaded_backward_bytes": tuple(int(b) if ok else None for b, ok in zip(bwd, memory.has_bwd))}


def _setting(prepared: Prepared) -> str:
    """What a plan that does not fit was for, beyond one device measured here, and what else can change."""
    parts, dist, prof = [], prepared.distributed, prepared.profile
    if dist is not None and dist.parallel == "fsdp":
        dtype = f", computing in {str(dist.param_dtype).removeprefix('torch.')}" if dist.param_dtype else ""
        parts.append(f"one rank of FSDP2 over {dist.world_size} ranks{dtype}: more ranks shard more")
    elif dist is not None and dist.parallel == "ddp":
        parts.append(f"one rank of DDP over {dist.world_size} ranks: FSDP (parallel='fsdp') shards parameters, "
                     "gradients and optimizer state")
    parts += [f"counted: {item}" for item in prepared.loop.counted()[:-1]]  # the last says where the output is
    if prof.estimated_for:
        parts.append(f"memory from shapes and times estimated for {prof.estimated_for}")
    elif prof.pieces > 1:
        parts.append(f"profiled in {prof.pieces} pieces, the whole step does not fit on {prof.device}")
    return "; ".join(parts)
