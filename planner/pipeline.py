"""``optimize()``: the whole pipeline, stage after stage, and nothing else."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable, Mapping, Sequence

import torch
from torch import nn

from planner.budget import check_budget, parse_budget
from planner.capture.api import capture
from planner.capture.cache import no_cache
from planner.capture.inputs import as_inputs
from planner.capture.scope import path_of
from planner.distributed.memory import setup, split_at_units
from planner.errors import OptionError
from planner.memory.model import ChunkPlan, MemoryModel
from planner.memory.regions import Regions
from planner.memory.simulate import freed_bytes, segment_recompute_us, simulate
from planner.plan import MemoryTimeline, Plan, Segment
from planner.prepared import Prepared, chunked
from planner.profiling.api import capture_inputs, profile_for
from planner.profiling.devices import is_device_spec, load_device, sac_op_cost
from planner.profiling.record import Profile
from planner.rewrite.graph import rewrite
from planner.rewrite.modules import clone_tree, describe, install_plan, tensor_shapes
from planner.solve.registry import capabilities, get_solver
from planner.solve.result import Solution
from planner.solving import left_s, solve_budget, solve_prepared
from planner.step import LossFn



def optimize(
    model: nn.Module,
    budget: int | str,
    *,
    inputs: tuple | Mapping | torch.Tensor | None = None,
    loss_fn: LossFn | None = None,
    time_limit_s: float = 30.0,
    solver: str = "cpsat",
    progress: Callable[[str], None] | None = None,
    profile: Profile | None = None,
    device: str | torch.device | None = None,
    world_size: int = 1,
    parallel: str | None = None,
    units: Sequence[str] | None = None,
    optimizer: str | int | None = None,
    selective: bool = True,
    must_save: Sequence[str] = (),
    must_recompute: Sequence[str] = (),
    max_chunks: int = 64,
    keep_output: bool = True,
) -> Plan:
    """Plans activation checkpointing so one training step of ``model`` fits ``budget``.

    Args:
        model: the model to train (not modified; ``plan.module`` shares its parameters).
        budget: peak memory of one training step: int bytes, ``"4GB"``, ``"4GiB"``,
            ``"512MB"``, ``"512MiB"`` or ``"60%"`` of the un-checkpointed peak.
        inputs: positional arguments (tuple) or keyword arguments (dict) for ``model``;
            default ``model.example_inputs``.
        loss_fn: ``output -> scalar`` differentiated by a step; default ``output.loss``
            or the sum of the floating outputs.
        time_limit_s: seconds the solve stage may take, all of it: the chunk DPs and CP-SAT, for each
            finer chunking ``plan_for`` widens to. Past it the best plan found is returned as FEASIBLE
            (``OutOfTime`` when none was found). Not counted: capture and profiling, which run the model
            and grow with it, and the smallest-peak DP that explains an infeasible budget (docs/solver.md,
            "Time limit"). Ctrl-C while CP-SAT searches ends the search the same way.
        solver: which planner chooses the segments; one of ``planner.solve.registry.SOLVERS``
            (``cpsat``, the default, is optimal under the cost model).
        max_chunks: most cut positions segments may start or end at (``regions.find_regions``);
            more give finer plans and a slower solve (docs/solver.md).
        progress: called with the name of each stage as it starts (``capture``, ``profile``,
            ``solve``, ``rewrite``), for progress displays.
        profile: a saved ``Profile`` (``planner.load_profile``) to plan from instead of profiling;
            the model is still captured, and must match it (``ProfileMismatch`` names what differs).
        device: plan for this device without it: a spec name (``"h100"``, ``planner.device_names()``)
            or spec file; memory from meta tensors, times from a roofline (docs/profiles.md).
        world_size: plan for one rank of a job on this many ranks (docs/distributed.md).
        parallel: ``fsdp`` (default when world_size > 1: parameters, gradients and optimizer
            state sharded 1/N, plus the all-gathered units in flight) or ``ddp`` (full replicas
            plus gradient buckets).
        units: FSDP units (module paths or globs like ``blocks.*``; default the repeated blocks),
            captured as calls so FSDP2's hooks run; segments consist of whole units.
        optimizer: count its state in the budget: ``adamw``, ``adam``, ``sgd``, ``sgd-momentum``,
            or the bytes of the whole model's state (sharded 1/N under FSDP).
        selective: let checkpointed segments keep chosen op outputs and re-run the rest (torch's
            selective checkpointing, docs/selective.md); False re-runs whole segments.
        must_save: module paths or op names (glob patterns) never re-run in backward.
        must_recompute: module paths or op names (glob patterns) re-run in backward, never kept.
        keep_output: whether the training loop keeps the model's output referenced through backward.
            True (default, and always safe): a plain loop, ``out = model(x); loss_fn(out).backward()``.
            False: the loop drops it first, as Hugging Face ``Trainer`` does; an LM's logits are then
            freed before backward, and plans for that loop can be tighter (docs/huggingface.md).

    Returns:
        The least-recompute ``Plan`` whose predicted peak fits the budget.

    Raises:
        InfeasibleBudget: no plan fits (under the overrides); carries the smallest reachable peak.
        OutOfTime: no plan was found within ``time_limit_s`` (a PlannerError; nothing is proven).
        BudgetError: a malformed budget. OptionError: an unknown solver or device, a pattern matching
            nothing, options that exclude each other. InputError: no inputs. (All are PlannerErrors;
            the first two are ValueErrors, InputError a TypeError.)
        CaptureError, ProfileError: the model could not be traced or run.

    Example:
        >>> plan = optimize(model, "60%", inputs=(x,))          # doctest: +SKIP
        >>> loss_fn(plan.module(x)).backward()                   # doctest: +SKIP
    """
    check_budget(budget)  # reject a malformed budget before any work
    get_solver(solver)  # reject an unknown solver before any work
    prepared = prepare(model, inputs=inputs, loss_fn=loss_fn, progress=progress, profile=profile, device=device,
                       world_size=world_size, parallel=parallel, units=units, optimizer=optimizer,
                       max_chunks=max_chunks, keep_output=keep_output)
    return plan_for(prepared, budget, solver=solver, time_limit_s=time_limit_s, progress=progress,
                    selective=selective, must_save=must_save, must_recompute=must_recompute)


def prepare(model: nn.Module, *, inputs: tuple | Mapping | torch.Tensor | None = None,
            loss_fn: LossFn | None = None, progress: Callable[[str], None] | None = None,
            profile: Profile | None = None, device: str | torch.device | None = None,
            world_size: int = 1, parallel: str | None = None, units: Sequence[str] | None = None,
            optimizer: str | int | None = None, max_chunks: int = 64, modules: bool = False,
            keep_output: bool = True) -> Prepared:
    """Captures and profiles ``model`` once (arguments as for ``optimize``). ``modules``: plan the
    model's own forward with module hooks even when torch.fx could trace it (``enable``)."""
    if isinstance(max_chunks, bool) or not isinstance(max_chunks, int) or max_chunks < 1:
        raise OptionError(f"max_chunks must be an int >= 1 (got {max_chunks!r}); e.g. max_chunks=128 for finer plans")
    stage = progress or (lambda name: None)
    dist = setup(model, world_size=world_size, parallel=parallel, units=units, optimizer=optimizer)
    example = as_inputs(model, inputs)
    with no_cache(model):  # use_cache=False in training calls, as Hugging Face's checkpointing does
        stage("capture")
        captured = capture(model, capture_inputs(model, example),   # graph + module scopes (meta inputs
                           units=dist.opaque if dist else frozenset(), modules=modules)  # for a meta model)
        stage("profile")
        measured = profile_for(captured, model, example, loss_fn=loss_fn,  # one real step node by node,
                               device=device, saved=profile,        # or a saved or estimated profile
                               keep_output=keep_output)
    sac = sac_op_cost(measured, load_device(device) if is_device_spec(device) else None)  # from the profile
    # or the device spec, never from this machine
    return chunked(Prepared(model=model, example=example, captured=captured, profile=measured, regions=None,
                             memory=None, baseline=None, sac_cost=sac, distributed=dist), max_chunks)




def plan_for(prepared: Prepared, budget: int | str, *, solver: str = "cpsat", time_limit_s: float = 30.0,
             progress: Callable[[str], None] | None = None, selective: bool = True,
             must_save: Sequence[str] = (), must_recompute: Sequence[str] = (),
             target: nn.Module | None = None) -> Plan:
    """Solves and rewrites a prepared model for one budget (arguments as for ``optimize``; ``target``
    as for ``plan_from_solution``).

    When no plan over the prepared chunks fits and the graph has more cut positions, the chunks are
    made finer (twice as many, up to ``WIDEST_CHUNKS``) until a plan fits; ``InfeasibleBudget`` then
    says whether infeasibility is proven over every cut position or only over those tried
    (``max_chunks``). All of it shares ``time_limit_s``: a finer chunking is not searched once it has
    run out (``InfeasibleBudget``, not proven), and ``OutOfTime`` when no plan was found at all."""
    stage = progress or (lambda name: None)
    budget_bytes = parse_budget(budget, baseline_peak_bytes=prepared.baseline.peak_bytes)
    stage("solve")
    started = time.perf_counter()
    deadline = started + time_limit_s  # one limit for every solve below, not one each
    prepared, solution = solve_prepared(prepared, solver, budget_bytes, deadline, dict(
        must_save=must_save, must_recompute=must_recompute,  # FSDP plans cut whole units: no saves there
        selective=selective and capabilities(solver).saves and prepared.distributed is None))
    memory, baseline = prepared.memory, prepared.baseline
    if prepared.distributed is not None:  # FSDP: at most one unit per segment (docs/distributed.md)
        solution = split_at_units(memory, solution, budget_bytes, prepared.distributed, prepared.profile,
                                  time_limit_s=left_s(deadline),
                                  resolve=lambda b: solve_budget(solver, memory, b, baseline.peak_bytes, deadline))
    solution = replace(solution, solve_time_s=time.perf_counter() - started)  # the whole stage, widening included
    stage("rewrite")
    return plan_from_solution(prepared, solution, budget_bytes, target=target)


def plan_from_solution(prepared: Prepared, solution: Solution, budget_bytes: int, *,
                       target: nn.Module | None = None) -> Plan:
    """The Plan (planned module included) for any strategy's solution of a prepared model.

    ``target``: for plans that run the model's own forward, the module tree to put the hooks on
    (``enable`` passes the model itself); default a clone of the model (``rewrite.modules.clone_tree``).
    """
    memory, baseline = prepared.memory, prepared.baseline
    segments = _segments(prepared.profile, prepared.regions, memory, solution.plan, solution.saves)
    predicted = simulate(memory, solution.plan, solution.saves)
    planned_inputs = {}
    if prepared.captured.method.runs_modules:
        planned_inputs = tensor_shapes(prepared.model, prepared.example.args, prepared.example.kwargs)
        module = clone_tree(prepared.model) if target is None else target
        source = describe([s.chain_spec() for s in segments], prepared.model)
    else:
        rewritten = rewrite(prepared.model, prepared.captured, [s.spec() for s in segments])
        module, source = rewritten.module, rewritten.source
    plan = Plan(
        module=module,
        budget_bytes=budget_bytes,
        predicted_peak_bytes=predicted.peak_bytes,
        baseline_peak_bytes=baseline.peak_bytes,
        predicted_overhead=solution.recompute_us / memory.step_us,
        recompute_ms=solution.recompute_us / 1000,
        step_ms=prepared.profile.step_ms,
        segments=segments,
        solver_status=solution.status,
        solve_time_s=solution.solve_time_s,
        recompute_bound_ms=(None if solution.bound_us is None  # nothing proven
                            else min(solution.bound_us, solution.recompute_us) / 1000),
        fingerprint=prepared.captured.fingerprint,
        capture_method=prepared.captured.method,
        capture_notes=prepared.captured.notes,
        device=prepared.profile.device,
        source=source,
        planned_inputs=planned_inputs,
        keep_output=prepared.profile.keep_output,
        peak_breakdown=predicted.breakdown,
        largest_kept=predicted.largest_kept,
        sac_op_us=prepared.sac_cost.op_us,
        sac_cost_source=prepared.sac_cost.source,
        timeline=MemoryTimeline(
            nodes=memory.node_names,
            forward_bytes=tuple(int(b) for b in predicted.fwd_bytes),
            backward_bytes=tuple(int(b) if ok else None for b, ok in zip(predicted.bwd_bytes, memory.has_bwd)),
            baseline_forward_bytes=tuple(int(b) for b in baseline.fwd_bytes),
            baseline_backward_bytes=tuple(int(b) if ok else None for b, ok in zip(baseline.bwd_bytes, memory.has_bwd)),
        ),
    )
    if prepared.captured.method.runs_modules:
        install_plan(module, [s.chain_spec() for s in segments], planned=plan.planned_shapes())
    return plan



def _segments(prof: Profile, regions: Regions, memory: MemoryModel, plan: ChunkPlan,
              saves: frozenset = frozenset()) -> tuple[Segment, ...]:
    out = []
    for (first, stop), freed in zip(plan, freed_bytes(memory, plan)):
        lo, hi = regions.starts[first], regions.bounds(stop - 1)[1]
        nodes = prof.nodes[lo:hi]
        mine = sorted(o for o in saves if lo <= o < hi)
        out.append(Segment(
            nodes=tuple(n.name for n in nodes),
            module_paths=_covering_paths(prof, lo, hi),
            recompute_ms=segment_recompute_us(memory, first, stop, mine) / 1000,
            freed_bytes=freed,
            restore_buffers=tuple(dict.fromkeys(b for n in nodes for b in n.mutated_buffers)),
            saved_nodes=tuple(prof.nodes[o].name for o in mine),
            chain=regions.chains[first, stop] if regions.chains is not None else (),
            saved_modules=tuple(prof.nodes[o].module_path for o in mine) if regions.chains is not None else (),
        ))
    return tuple(out)


def _covering_paths(prof: Profile, lo: int, hi: int) -> tuple[str, ...]:
    """Outermost module calls wholly inside nodes ``lo:hi``, and ``path:op`` for ops outside them."""
    inside: dict[str, bool] = {}
    for i, node in enumerate(prof.nodes):
        for entry in node.scope:
            inside[entry] = inside.get(entry, True) and lo <= i < hi
    paths: dict[str, None] = {}
    for node in prof.nodes[lo:hi]:
        whole = next((e for e in node.scope if inside[e]), None)
        if whole is not None:
            paths.setdefault(path_of(whole), None)
        elif node.kind != "get_attr":
            paths.setdefault(f"{node.module_path or '<root>'}:{node.target.rsplit('.', 1)[-1]}", None)
    return tuple(paths)
