"""The solve stage of ``plan_for``: a prepared model's plan for a byte budget, at its chunking or finer ones.

The strategy (``planner.solve``) plans over the prepared chunks. When none of their plans fits and the
graph has more cut positions, finer chunkings are tried (``widen``); InfeasibleBudget says whether
infeasibility is proven over every cut position. Before that, the chunking is made finer while the
time limit allows and the whole-segment DPs say finer chunks re-run less (``refine``). One ``Deadline``
bounds all of it.
"""

from __future__ import annotations

import time
from dataclasses import replace

from planner.common.budget import format_bytes
from planner.errors import InfeasibleBudget, OptionError, OutOfTime, PlannerError
from planner.memory.candidates import save_options
from planner.memory.model import MemoryModel
from planner.memory.saves import SaveOptions
from planner.memory.simulate import Timeline, simulate
from planner.options import PlanOptions
from planner.planning.prepared import Prepared, chunked
from planner.solve.baselines import hand_placements
from planner.solve.deadline import Deadline
from planner.solve.peaks import min_peak_saves
from planner.solve.registry import capabilities, get_solver
from planner.solve.result import NoSolution, Solution, SolverStatus
from planner.solve.rotor import relaxed, rotor

WIDEST_CHUNKS = 256
"""Finest chunking ``plan_for`` goes to on its own (``widen``, ``refine``)."""


REFINE_GAIN = 0.02
"""Least share of the whole-segment recompute that the chunking twice as fine must be able to spare (by
its relaxation's bound) before ``refine`` moves to it."""
REFINE_TIME = 6.0
"""``refine`` moves on only while the time left is this many times what the next chunking's two DPs are
expected to take (four times the last one's: they grow with the square of the chunks). The solve that
follows runs them again, then the save-variant DP (about twice as long) and CP-SAT for shares of the
limit (``solve.default.POLISH_SHARE``)."""


def solve_prepared(prepared: Prepared, budget_bytes: int, options: PlanOptions,
                   deadline: Deadline, *, explain: bool = True) -> tuple[Prepared, Solution]:
    """The plan for ``budget_bytes`` with the ``Prepared`` it belongs to: the chunking chosen by ``refine``,
    solved there, or at finer chunkings when none fits (``widen``), all before ``deadline``. Without ``explain``,
    no plan is ``InfeasibleBudget`` without the smallest peak, which takes a search of its own."""
    if capabilities(options.solver).reads_budget:
        prepared = refine(prepared, budget_bytes, deadline)
    return widen(prepared, budget_bytes, options, deadline, explain=explain)


def refine(prepared: Prepared, budget_bytes: int, deadline: Deadline) -> Prepared:
    """The chunking to solve at: finer than the prepared one while that pays. When the chunks leave cut
    positions out (``Regions.capped``), finer ones may hold plans that re-run less. The whole-segment
    DPs decide, fast and the same for every strategy that reads the budget, so that a selective plan is
    never worse than the whole-segment one: the chunking twice as fine is taken when its relaxation's
    bound is at least ``REFINE_GAIN`` below the best whole-segment plan so far and its own DP (Rotor)
    finds a cheaper plan, while the time left covers ``REFINE_TIME`` times the next DPs. Running out of
    time keeps the chunking reached. Not where FSDP units captured as calls fix the chunking
    (``SegmentRules.refinable``)."""
    if (not prepared.rules.refinable or not prepared.regions.capped
            or budget_bytes >= prepared.baseline.peak_bytes):
        return prepared
    began = time.perf_counter()
    try:
        cost = rotor(prepared.memory, budget_bytes, deadline=deadline).recompute_us
    except NoSolution:  # no whole-segment plan here: widen's business
        return prepared
    spent = 2 * (time.perf_counter() - began)  # the relaxation takes about as long
    while (prepared.regions.capped and prepared.regions.n_chunks < WIDEST_CHUNKS
           and REFINE_TIME * 4 * spent <= deadline.left_s()):
        began = time.perf_counter()
        finer = chunked(prepared, 2 * prepared.regions.n_chunks)
        try:
            lower = relaxed(finer.memory, budget_bytes, deadline=deadline)
            if lower is None or lower[1] > cost * (1 - REFINE_GAIN):
                break  # the finer chunks cannot spare enough
            found = rotor(finer.memory, budget_bytes, deadline=deadline).recompute_us
        except NoSolution:  # out of time
            break
        spent = time.perf_counter() - began
        if found >= cost:
            break
        prepared, cost = finer, found
    return prepared


def widen(prepared: Prepared, budget_bytes: int, options: PlanOptions,
          deadline: Deadline, *, explain: bool = True) -> tuple[Prepared, Solution]:
    """The solution at the prepared chunking, else at finer ones (see ``plan_for``), with the
    ``Prepared`` it belongs to (``explain`` as for ``solve_prepared``)."""
    overrides = bool(options.must_save or options.must_recompute)
    first: InfeasibleBudget | None = None
    try:  # unexplained while finer chunkings may hold a plan: the smallest peak's search would take the time
        return prepared, solve_budget(options.solver, prepared.memory, budget_bytes, prepared.baseline.peak_bytes,
                                      deadline, save_options_for(prepared, options),
                                      explain=explain and (overrides or not prepared.regions.capped))
    except InfeasibleBudget as exc:
        first = exc
    except _NoPlan:
        if not explain:
            first = InfeasibleBudget(budget_bytes, None)
    memory = prepared.memory
    dist = prepared.distributed
    grads = prepared.profile.grad_bytes if dist is None or dist.parallel != "fsdp" else \
        sum(dist.sharded_grad_bytes.values())  # what one rank keeps after backward
    below_fixed = budget_bytes < memory.param_bytes + grads  # no plan frees either
    if (first is not None and first.reason) or below_fixed or not prepared.regions.capped:
        raise first or _smallest(memory, budget_bytes, deadline)[0]  # the overrides, or proven: none finer helps
    if not prepared.rules.refinable:  # FSDP units captured as calls fix the chunking: not widened
        raise _unproven(first or _smallest(memory, budget_bytes, deadline)[0], prepared)
    chunks, first_prepared = prepared.regions.n_chunks, prepared
    searched, out_of_time = prepared, False
    while prepared.regions.capped and chunks < WIDEST_CHUNKS:
        searched = prepared
        if deadline.passed:
            out_of_time = True
            break
        chunks *= 2
        prepared = chunked(prepared, chunks)
        try:
            if prepared.regions.capped and relaxed(prepared.memory, budget_bytes, deadline=deadline) is None:
                continue  # not even the relaxation has a plan at this chunking; perhaps at a finer one
            if capabilities(options.solver).reads_budget:
                prepared = refine(prepared, budget_bytes, deadline)  # plans exist here: finer may re-run less
            return prepared, solve_budget(options.solver, prepared.memory, budget_bytes,
                                          prepared.baseline.peak_bytes, deadline, save_options_for(prepared, options),
                                          explain=explain and not prepared.regions.capped)  # else a finer one
        except (NoSolution, OutOfTime):  # the DP screen or the solve ran out of time at this chunking
            out_of_time = True
            break
        except _NoPlan:
            pass
    found = _every_block(first_prepared, budget_bytes, deadline)
    if found is not None:
        return found
    if not explain:
        raise InfeasibleBudget(budget_bytes, None)
    if out_of_time:  # the smallest peak at the prepared chunking
        return _smallest_fitting(first_prepared, first, budget_bytes, deadline, searched=searched, out_of_time=True)
    # the smallest peak at the finest chunking searched
    return _smallest_fitting(prepared, first if prepared is first_prepared else None, budget_bytes, deadline,
                             searched=prepared)


def _smallest_fitting(prepared: Prepared, known: InfeasibleBudget | None, budget_bytes: int, deadline: Deadline, *,
                      searched: Prepared, out_of_time: bool = False) -> tuple[Prepared, Solution]:
    """The plan of the smallest peak at ``prepared``'s chunking when it fits the budget (a budget at that peak,
    where the strategy's search ran out of time or found nothing at the chunkings tried: FEASIBLE, nothing
    proven); else ``InfeasibleBudget`` (``known`` when the first chunking's solve already explained itself),
    not proven past ``searched``'s chunks."""
    if known is None:
        known, smallest = _smallest(prepared.memory, budget_bytes, deadline)
        if smallest.peak_bytes <= budget_bytes:
            return prepared, Solution(plan=smallest.plan, status=SolverStatus.FEASIBLE,
                                      recompute_us=smallest.recompute_us, bound_us=None, solve_time_s=0.0,
                                      saves=smallest.saves)
    raise _unproven(known, searched, out_of_time=out_of_time)


BLOCK_DP_SHARE = 0.5
"""Share of the time left that the chunk DP gets at one chunk per block, to beat the placements by hand."""


def _every_block(prepared: Prepared, budget_bytes: int, deadline: Deadline) -> tuple[Prepared, Solution] | None:
    """Before saying no plan was found: a chain of more blocks (or loop steps) than the chunkings searched
    holds the placements people make by hand, which may fit. At one cut per block edge: the cheapest that fits
    of those (``baselines.hand_placements``: every block alone, ``checkpoint_sequential``'s groups), or the chunk
    DP's plan when it finds one that re-runs less in ``BLOCK_DP_SHARE`` of the time left (FEASIBLE either way:
    nothing proven); None when none fits. The DP alone can miss them: on an RNN whose every step's output is read
    at the end, its conservative reading of the many storages open across a cut puts its smallest peak above the
    hand placement's."""
    blocks = prepared.regions.block_count
    if not blocks or blocks < prepared.regions.n_chunks or not prepared.rules.refinable:
        return None
    fine = chunked(prepared, prepared.regions.block_cuts + 1)  # a cut at every block edge
    if len(fine.regions.blocks) != blocks:
        return None
    began = time.perf_counter()
    best: Solution | None = None
    for plan in hand_placements(fine.memory):
        timeline = simulate(fine.memory, plan)
        if timeline.peak_bytes <= budget_bytes and (best is None or timeline.recompute_us < best.recompute_us):
            best = Solution(plan=plan, status=SolverStatus.FEASIBLE, recompute_us=timeline.recompute_us,
                            bound_us=None, solve_time_s=0.0)
    if best is None:
        return None
    try:
        found = rotor(fine.memory, budget_bytes, deadline=deadline.within(BLOCK_DP_SHARE * deadline.left_s()))
        if (found.recompute_us < best.recompute_us
                and simulate(fine.memory, found.plan).peak_bytes <= budget_bytes):  # RNG stashes included
            best = replace(found, status=SolverStatus.FEASIBLE, bound_us=None)
    except NoSolution:  # out of time, or none under the DP's conservative reading: the placement by hand fits
        pass
    return fine, replace(best, solve_time_s=time.perf_counter() - began)


def _unproven(exc: InfeasibleBudget, prepared: Prepared, *, out_of_time: bool = False) -> InfeasibleBudget:
    """``exc`` marked as searched over at most ``prepared.regions.n_chunks`` chunks only; ``out_of_time``:
    because the time limit ran out before finer chunkings were searched."""
    reason = "the time limit ran out before finer chunks were searched (raise time_limit_s)" if out_of_time else ""
    return InfeasibleBudget(exc.budget_bytes, exc.min_peak_bytes, exc.breakdown, exc.reason or reason,
                            max_chunks=prepared.regions.n_chunks)


class _NoPlan(Exception):
    """No plan fits at this chunking, left unexplained (a finer chunking is tried next)."""


def save_options_for(prepared: Prepared, options: PlanOptions) -> SaveOptions:
    """The save candidates and overrides at the prepared chunking (FSDP's gathered units, an optimizer's state
    or DDP's buckets change nothing inside a segment: saves as on one device)."""
    can_save = capabilities(options.solver).saves
    if (options.must_save or options.must_recompute) and not can_save:
        raise OptionError(f"must_save/must_recompute need the cpsat solver, not {options.solver!r}")
    return save_options(prepared.profile, prepared.memory, savable=prepared.rules.savable,
                        must_save=options.must_save, must_recompute=options.must_recompute,
                        selective=options.selective and can_save)


def solve_budget(solver: str, memory: MemoryModel, budget_bytes: int, baseline_peak: int,
                 deadline: Deadline, options: SaveOptions | None = None, *, explain: bool = True) -> Solution:
    """The plan for a budget: empty when it already fits, else the strategy's, checked against the budget.

    The strategy works until ``deadline``; ``OutOfTime`` when it found no plan by then. No plan that fits:
    ``InfeasibleBudget`` with the smallest peak (the chunk DP's, which runs to the end: about 1 s at 64
    chunks on 2700 nodes), or ``_NoPlan`` without ``explain``."""
    overrides = options if options is not None and (options.must_save or options.must_recompute) else None
    if budget_bytes >= baseline_peak and not (overrides is not None and overrides.must_recompute):
        return Solution(plan=(), status=SolverStatus.OPTIMAL, recompute_us=0, bound_us=0, solve_time_s=0.0)
    solution = _stashes_included(solver, memory, budget_bytes, deadline, options)
    if solution is not None and simulate(memory, solution.plan, solution.saves).peak_bytes <= budget_bytes:
        return solution
    if not explain:
        raise _NoPlan()
    if overrides is not None:
        _infeasible_overrides(memory, budget_bytes, overrides, deadline)
    infeasible, smallest = _smallest(memory, budget_bytes, deadline)
    if smallest.peak_bytes <= budget_bytes and capabilities(solver).reads_budget:
        # the RNG states its plans stash left the strategy's plans over: the smallest peak's plan fits
        return Solution(plan=smallest.plan, status=SolverStatus.FEASIBLE, recompute_us=smallest.recompute_us,
                        bound_us=None, solve_time_s=0.0, saves=smallest.saves)
    if infeasible.min_peak_bytes is not None and infeasible.min_peak_bytes <= budget_bytes:
        # a fixed or conservative strategy missed what cpsat can do
        peak = "no plan" if solution is None else f"a plan peaking at {simulate(memory, solution.plan).peak_bytes} B"
        raise PlannerError(f"solver {solver!r} finds {peak} for a budget of {budget_bytes} B, which plans down to "
                           f"{infeasible.min_peak_bytes} B fit; use the cpsat solver (solver='cpsat', ckplan "
                           "--solver cpsat)")
    raise infeasible


STASH_RETRIES = 3
"""Most times ``solve_budget`` solves again under a lower budget for the RNG state its plan's checkpoints stash."""


def _stashes_included(solver: str, memory: MemoryModel, budget_bytes: int, deadline: Deadline,
                      options: SaveOptions | None) -> Solution | None:
    """The strategy's plan for ``budget_bytes`` (None when it proves there is none; ``OutOfTime`` when it found
    none in time). The chunk solvers leave out the RNG state a segment drawing random numbers stashes
    (``MemoryModel.stash_bytes``, a few KiB on a CPU), which ``simulate`` counts: while the plan's simulated
    peak is over the budget by it, the strategy solves again under a budget that much lower. The first solve's
    bound still bounds every plan that fits, so the plan is OPTIMAL when it meets that bound."""
    target, first = budget_bytes, None
    for _ in range(STASH_RETRIES + 1):
        try:
            solution = get_solver(solver)(memory, target, deadline=deadline, options=options)
        except NoSolution as exc:
            if not exc.infeasible:
                raise OutOfTime(str(exc)) from exc
            return None
        first = first or solution
        over = simulate(memory, solution.plan, solution.saves).peak_bytes - budget_bytes
        if over <= 0 or not memory.stash_bytes or not capabilities(solver).reads_budget:
            break
        target -= over
    if first is None or solution is first:
        return solution
    optimal = first.bound_us is not None and solution.recompute_us <= first.bound_us
    return replace(solution, bound_us=first.bound_us,
                   status=SolverStatus.OPTIMAL if optimal else SolverStatus.FEASIBLE)


EXPLAIN_S = 5.0
"""Least time the smallest peak's search gets to improve on the chunk DP's (CP-SAT, where the DP does not track
every storage), even when the time limit has passed: the error's figure."""


def _smallest(memory: MemoryModel, budget_bytes: int, deadline: Deadline) -> tuple[InfeasibleBudget, Timeline]:
    """What to say when no plan fits: the smallest peak any plan reaches over these chunks, and what it is
    made of (the chunk DP's, which runs to the end: about 1 s at 64 chunks on 2700 nodes; CP-SAT's after it
    until ``deadline`` or for ``EXPLAIN_S``, whichever is later); with that plan's timeline."""
    best = simulate(memory, *min_peak_saves(memory, deadline=max(deadline, Deadline.after(EXPLAIN_S),
                                                                 key=lambda d: d.at)))
    largest = tuple((name, nbytes) for name, nbytes, _ in best.largest_kept)
    return InfeasibleBudget(budget_bytes, best.peak_bytes, replace(best.breakdown, largest_kept=largest)), best


def _infeasible_overrides(memory: MemoryModel, budget_bytes: int, options: SaveOptions, deadline: Deadline) -> None:
    """Raises InfeasibleBudget saying the user's overrides are what makes the budget infeasible."""
    overrides = SaveOptions(must_save=options.must_save, must_recompute=options.must_recompute)
    try:
        best = simulate(memory, *min_peak_saves(memory, deadline=deadline, options=overrides))
    except NoSolution as exc:
        if not exc.infeasible:  # out of time: nothing is known about the overrides
            raise PlannerError(f"no plan under must_save/must_recompute fits {format_bytes(budget_bytes)}, and the "
                               "smallest peak they allow was not found within the time limit; raise "
                               "time_limit_s to learn it") from exc
        # no plan satisfies them at all: there is no smallest peak to report
        raise InfeasibleBudget(budget_bytes, None, None, "must_save/must_recompute contradict each other (a node "
                               "must be re-run in a chunk where another must not be)") from None
    free = simulate(memory, *min_peak_saves(memory, deadline=deadline)).peak_bytes
    if free <= budget_bytes:
        raise InfeasibleBudget(budget_bytes, best.peak_bytes, best.breakdown,
                               f"must_save/must_recompute make the budget infeasible (without them plans reach "
                               f"{format_bytes(free)})")
