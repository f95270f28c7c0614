"""``optimize()``: the whole pipeline, stage after stage, and nothing else."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Sequence

import torch
from torch import nn

from planner.budget import check_budget, format_bytes, parse_budget
from planner.capture.api import Captured, capture
from planner.capture.inputs import Inputs, as_inputs
from planner.profiling.record import Profile
from planner.distributed.memory import Distributed, memory_offset, setup, split_at_units
from planner.errors import InfeasibleBudget, OptionError, OutOfTime, PlannerError
from planner.plan import MemoryTimeline, Plan, Segment
from planner.profiling.api import capture_inputs, profile_for
from planner.memory.regions import Regions, find_regions
from planner.profiling.devices import SacCost, is_device_spec, load_device, sac_op_cost
from planner.capture.cache import no_cache
from planner.memory.chains import alone_in_module
from planner.rewrite.graph import rewrite
from planner.rewrite.modules import clone_tree, describe, install_plan, tensor_shapes
from planner.memory.saves import SaveOptions
from planner.memory.model import ChunkPlan, MemoryModel, build_model
from planner.memory.simulate import Timeline, freed_bytes, segment_recompute_us, simulate
from planner.solve.peaks import min_peak_saves
from planner.solve.rotor import relaxed
from planner.solve.result import NoSolution, Solution, SolverStatus
from planner.solve.registry import capabilities, get_solver
from planner.step import LossFn
from planner.capture.scope import path_of


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
    return _chunked(Prepared(model=model, example=example, captured=captured, profile=measured, regions=None,
                             memory=None, baseline=None, sac_cost=sac, distributed=dist), max_chunks)


def _chunked(prepared: Prepared, max_chunks: int) -> Prepared:
    """``prepared`` with its regions (at most ``max_chunks`` chunks) and the cost model over them."""
    measured, dist = prepared.profile, prepared.distributed
    regions = find_regions(measured, max_chunks=max_chunks,      # where segments may start and end:
                           modules=prepared.captured.method.runs_modules)  # chains of module calls for hooks
    memory = build_model(measured, regions,                      # the cost model the solver optimises
                         offset=dist and memory_offset(measured, dist),  # one rank's share of the job
                         sac_op_us=prepared.sac_cost.op_us)
    return replace(prepared, regions=regions, memory=memory, baseline=simulate(memory, ()))


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
    prepared, solution = _solve_widening(prepared, solver, budget_bytes, deadline, dict(
        must_save=must_save, must_recompute=must_recompute,  # FSDP plans cut whole units: no saves there
        selective=selective and capabilities(solver).saves and prepared.distributed is None))
    memory, baseline = prepared.memory, prepared.baseline
    if prepared.distributed is not None:  # FSDP: at most one unit per segment (docs/distributed.md)
        solution = split_at_units(memory, solution, budget_bytes, prepared.distributed, prepared.profile,
                                  time_limit_s=_left_s(deadline),
                                  resolve=lambda b: _solve(solver, memory, b, baseline.peak_bytes, deadline))
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


WIDEST_CHUNKS = 256
"""Finest chunking ``plan_for`` widens to on its own when the prepared chunks admit no plan."""


def _solve_widening(prepared: Prepared, solver: str, budget_bytes: int, deadline: float,
                    save_args: dict) -> tuple[Prepared, Solution]:
    """The solution at the prepared chunking, else at finer ones (see ``plan_for``), with the
    ``Prepared`` it belongs to. Every solve gets the time left before ``deadline`` (``time.perf_counter()``)."""
    try:
        return prepared, _solve(solver, prepared.memory, budget_bytes, prepared.baseline.peak_bytes, deadline,
                                _save_options(prepared, solver, save_args))
    except InfeasibleBudget as exc:
        first = exc
    memory = prepared.memory
    below_fixed = budget_bytes < memory.param_bytes + prepared.profile.grad_bytes  # no plan frees either
    if first.reason or below_fixed or not prepared.regions.capped:
        raise first  # the overrides, or proven: no finer chunking can help
    if prepared.distributed is not None:
        raise _unproven(first, prepared)  # FSDP units fix the chunking: not widened
    chunks = prepared.regions.n_chunks
    while prepared.regions.capped and chunks < WIDEST_CHUNKS:
        searched = prepared
        if _left_s(deadline) == 0:
            raise _unproven(first, searched, out_of_time=True)
        chunks *= 2
        prepared = _chunked(prepared, chunks)
        try:
            if prepared.regions.capped and relaxed(prepared.memory, budget_bytes, deadline=deadline) is None:
                continue  # not even the relaxation has a plan at this chunking; perhaps at a finer one
            return prepared, _solve(solver, prepared.memory, budget_bytes, prepared.baseline.peak_bytes,
                                    deadline, _save_options(prepared, solver, save_args),
                                    explain=not prepared.regions.capped)  # else a finer chunking is next
        except (NoSolution, OutOfTime):  # the DP screen or the solve ran out of time at this chunking
            raise _unproven(first, searched, out_of_time=True) from None
        except _NoPlan:
            pass
    raise _unproven(first, prepared)


def _unproven(exc: InfeasibleBudget, prepared: Prepared, *, out_of_time: bool = False) -> InfeasibleBudget:
    """``exc`` marked as searched over at most ``prepared.regions.n_chunks`` chunks only; ``out_of_time``:
    because the time limit ran out before finer chunkings were searched."""
    reason = "the time limit ran out before finer chunks were searched (raise time_limit_s)" if out_of_time else ""
    return InfeasibleBudget(exc.budget_bytes, exc.min_peak_bytes, exc.breakdown, exc.reason or reason,
                            max_chunks=prepared.regions.n_chunks)


class _NoPlan(Exception):
    """No plan fits at this chunking, left unexplained (a finer chunking is tried next)."""


def _save_options(prepared: Prepared, solver: str, save_args: dict) -> SaveOptions:
    """The save candidates and overrides at the prepared chunking."""
    from planner.rewrite.candidates import save_options

    savable = (alone_in_module(prepared.profile, prepared.memory.regions.end)
               if prepared.captured.method.runs_modules else None)  # hooks keep whole module calls of one op
    options = save_options(prepared.captured.graph_module, prepared.profile, prepared.memory, savable=savable,
                           **save_args)
    if (options.must_save or options.must_recompute) and not capabilities(solver).saves:
        raise OptionError(f"must_save/must_recompute need the cpsat solver, not {solver!r}")
    return options


def _left_s(deadline: float) -> float:
    """Seconds left before ``deadline`` (a ``time.perf_counter()`` value), never below 0."""
    return max(0.0, deadline - time.perf_counter())


def _solve(solver: str, memory: MemoryModel, budget_bytes: int, baseline_peak: int,
           deadline: float, options: SaveOptions | None = None, *, explain: bool = True) -> Solution:
    """The plan for a budget: empty when it already fits, else the strategy's, checked against the budget.

    The strategy gets the time left before ``deadline`` (``time.perf_counter()``); ``OutOfTime`` when it
    found no plan in it. No plan that fits: ``InfeasibleBudget`` with the smallest peak (the chunk DP's,
    which runs to the end: about 1 s at 64 chunks on 2700 nodes), or ``_NoPlan`` without ``explain``."""
    overrides = options is not None and bool(options.must_save or options.must_recompute)
    if budget_bytes >= baseline_peak and not (overrides and options.must_recompute):
        return Solution(plan=(), status=SolverStatus.OPTIMAL, recompute_us=0, bound_us=0, solve_time_s=0.0)
    try:
        if options is not None and not options.trivial:
            solution = get_solver(solver)(memory, budget_bytes, time_limit_s=_left_s(deadline), options=options)
        else:
            solution = get_solver(solver)(memory, budget_bytes, time_limit_s=_left_s(deadline))
    except NoSolution as exc:
        if exc.interrupted:  # Ctrl-C before any plan was found: nothing to return
            raise KeyboardInterrupt from exc
        if not exc.infeasible:
            raise OutOfTime(str(exc)) from exc
        solution = None
    if solution is not None and simulate(memory, solution.plan, solution.saves).peak_bytes <= budget_bytes:
        return solution
    if not explain:
        raise _NoPlan()
    if overrides:
        _infeasible_overrides(memory, budget_bytes, options, deadline)
    best = simulate(memory, *min_peak_saves(memory, time_limit_s=_left_s(deadline)))
    if best.peak_bytes <= budget_bytes:  # a fixed or conservative strategy missed what cpsat can do
        peak = "no plan" if solution is None else f"a plan peaking at {simulate(memory, solution.plan).peak_bytes} B"
        raise PlannerError(f"solver {solver!r} finds {peak} for a budget of {budget_bytes} B, which plans down to "
                           f"{best.peak_bytes} B fit; use the cpsat solver (solver='cpsat', ckplan --solver cpsat)")
    largest = tuple((name, nbytes) for name, nbytes, _ in best.largest_kept)
    raise InfeasibleBudget(budget_bytes, best.peak_bytes, replace(best.breakdown, largest_kept=largest))


def _infeasible_overrides(memory: MemoryModel, budget_bytes: int, options: SaveOptions, deadline: float):
    """Raises InfeasibleBudget saying the user's overrides are what makes the budget infeasible."""
    overrides = SaveOptions(must_save=options.must_save, must_recompute=options.must_recompute)
    try:
        best = simulate(memory, *min_peak_saves(memory, time_limit_s=_left_s(deadline), options=overrides))
    except NoSolution as exc:
        if exc.interrupted:
            raise KeyboardInterrupt from exc
        if not exc.infeasible:  # out of time: nothing is known about the overrides
            raise PlannerError(f"no plan under must_save/must_recompute fits {format_bytes(budget_bytes)}, and the "
                               "smallest peak they allow was not found within the time limit; raise "
                               "time_limit_s to learn it") from exc
        # no plan satisfies them at all: there is no smallest peak to report
        raise InfeasibleBudget(budget_bytes, None, None, "must_save/must_recompute contradict each other (a node "
                               "must be re-run in a chunk where another must not be)") from None
    free = simulate(memory, *min_peak_saves(memory, time_limit_s=_left_s(deadline))).peak_bytes
    if free <= budget_bytes:
        raise InfeasibleBudget(budget_bytes, best.peak_bytes, best.breakdown,
                               f"must_save/must_recompute make the budget infeasible (without them plans reach "
                               f"{format_bytes(free)})")


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
