"""The CP-SAT model of the plan space: least recompute time under a peak budget.

The model encodes the formulas of ``planner.memory.simulate`` over chunks (see
``docs/memory-model.md``); it never sees torch objects, only the arrays of a
``MemoryModel``. Build, solve and read back are separate functions.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np
from ortools.sat.python import cp_model

from planner.memory.model import ChunkPlan, MemoryModel, prefix_by
from planner.memory.reruns import rerun_chunk, rerun_skip_us
from planner.memory.saves import NEVER, SaveOptions
from planner.memory.simulate import recomputed_from, rerun_bytes, simulate
from planner.solve.cpsat_saves import (
    add_saves,
    backward_reliefs,
    cache_items,
    objective_relief,
    relief_rows,
    rerun_limits,
    sac_overhead,
    same_segment,
)
from planner.solve.deadline import Deadline
from planner.solve.incumbent import Incumbent
from planner.solve.result import Failure, NoSolution, Solution, SolverStatus


@dataclass(kw_only=True, slots=True)
class _Vars:
    segment: dict         # segment[a, b]: chunks a..b-1 form one checkpointed segment
    covers: dict          # covers[a, k]: the segment starting at chunk a reaches chunk k
    ckpt: list            # ckpt[k]: chunk k is inside some checkpointed segment
    kept: dict            # kept[s]: storage s stays alive from forward until its release in backward
    save: dict            # save[o]: node o's outputs are cached by selective checkpointing, not re-run
    same: dict            # same[o, k]: o is saved and chunk k is in its segment
    sac: object = 0       # time SAC's dispatch modes add to segments with saves (objective term)
    cache: list           # (storage, release, save[o]): cached storages nobody saves, kept until the re-run
    held: dict            # held[s]: [(node, h)], h: some holder of s sits at or before node (ascending)
    eager: dict           # eager[t]: node t's modules keep their Python locals (planner.memory.excess)
    rows: dict            # rows[o]: per node, the bytes a save of o keeps from being counted as recomputed


def build(model: MemoryModel, *, budget_bytes: int | None, options: SaveOptions | None = None,
          deadline: Deadline | None = None) -> tuple[cp_model.CpModel, _Vars, cp_model.IntVar | None]:
    """Builds the CP-SAT model. With ``budget_bytes=None`` it minimises the peak instead
    and returns the peak variable as third element. ``options``: op-level saves and overrides.

    Building counts against ``deadline``: with op-level saves on a few thousand nodes it takes about 1 s,
    several times that on a loaded machine, mostly in the re-run limits, which check it once per segment.

    Raises:
        NoSolution: ``deadline`` passed while building (OUT_OF_TIME)."""
    cp = cp_model.CpModel()
    n_chunks = model.n_chunks
    ok = model.regions.checkpointable
    # segment[a, b]: chunks a..b-1 are one checkpointed segment (one the regions allow).
    segment = {}
    for a in range(n_chunks):
        for b in range(a + 1, n_chunks + 1):
            if not ok[b - 1]:
                break
            if model.regions.allows(a, b):
                segment[a, b] = cp.new_bool_var(f"segment[{a},{b}]")
    # covers[a, k]: the segment that starts at a extends at least to chunk k.
    covers: dict[tuple[int, int], cp_model.IntVar] = {}
    for a in range(n_chunks):
        for k in range(n_chunks - 1, a - 1, -1):
            here, longer = segment.get((a, k + 1)), covers.get((a, k + 1))
            if here is None and longer is None:
                continue
            var = cp.new_bool_var(f"covers[{a},{k}]")
            cp.add(var == (0 if here is None else here) + (0 if longer is None else longer))
            covers[a, k] = var
    # ckpt[k]: at most one segment covers chunk k.
    ckpt = []
    for k in range(n_chunks):
        terms = [covers[a, k] for a in range(k + 1) if (a, k) in covers]
        var = cp.new_bool_var(f"ckpt[{k}]") if terms else cp.new_constant(0)
        if terms:
            cp.add(var == sum(terms))
        ckpt.append(var)
    save, save_reasons = add_saves(cp, model, options, ckpt, covers) if options is not None else ({}, {})
    # kept[s]: some un-checkpointed node saves s, or a segment starting after s's chunk reads it.
    # kept[s] is exactly the OR of its reasons, so the search only ever branches on segments.
    kept = {}
    for s in model.varying():
        var = cp.new_bool_var(f"kept[{s}]")
        reasons = [h for _, h in _holder_literals(model, int(s), ckpt, covers, save_reasons)]
        for h in reasons:
            cp.add_implication(h, var)
        cp.add_bool_or(reasons).only_enforce_if(var)
        kept[int(s)] = var
    rows = relief_rows(model, save)
    variables = _Vars(segment=segment, covers=covers, ckpt=ckpt, kept=kept, save=save,
                      held=_holders(cp, model, ckpt, covers, save_reasons),
                      eager=_eager(cp, model, segment, covers, ckpt),
                      same=same_segment(cp, model, save, covers, rows), rows=rows,
                      sac=sac_overhead(cp, model, save, covers), cache=cache_items(model, save))
    peak = cp.new_int_var(0, _upper_bound(model), "peak") if budget_bytes is None else None
    limit = peak if peak is not None else budget_bytes
    _add_forward_limits(cp, model, variables, limit)
    _add_backward_limits(cp, model, variables, limit, deadline)
    if peak is None:
        cp.minimize(_objective(model, variables))
    else:
        cp.minimize(peak)
    return cp, variables, peak


def _holder_literals(model: MemoryModel, s: int, ckpt: list, covers: dict,
                     save_reasons: dict) -> list[tuple[int, cp_model.LiteralT]]:
    """``(node, literal)`` per holder of storage s a plan may choose (``planner.memory.release``): a chunk
    left alone that saves it (from its first saver there), a segment starting after s's chunk that reads
    it (from its first node), a save in the segment of s's first saver (a save keeps its cached storages).
    s is kept iff one of them holds."""
    out = [(u, ckpt[k].Not()) for k, u in model.saver_firsts[s]]
    p = int(model.producer_chunk[s])
    for w in model.consumer_chunks[s]:
        out += [(model.regions.starts[a], covers[a, w]) for a in range(p + 1, w + 1) if (a, w) in covers]
    out += [(int(model.first_saver[s]), v) for v in save_reasons.get(s, ())]
    return out


def _holders(cp, model: MemoryModel, ckpt: list, covers: dict, save_reasons: dict) -> dict:
    """``held[s]``: for every storage a plan may keep, ``[(node, h), ...]`` by ascending node, ``h``
    true when some holder of s sits at or before that node (``planner.memory.release``): s is alive
    at backward node t iff the last ``h`` at or before t is. Each ``h`` is only bounded from below
    (by its holders and the previous one); the backward limits keep it as small as allowed."""
    held = {}
    for s in range(len(model.size)):
        if model.size[s] <= 0 or not (model.always_kept[s] or int(s) in save_reasons
                                      or model.saver_chunks[s] or model.consumer_chunks[s]):
            continue
        at: dict[int, list] = {}
        if model.fixed_release[s] < NEVER:
            at[int(model.fixed_release[s])] = [1]
        for node, h in _holder_literals(model, int(s), ckpt, covers, save_reasons):
            at.setdefault(node, []).append(h)
        chain, previous = [], 0
        for node in sorted(at):
            if any(isinstance(h, int) for h in at[node]):
                chain.append((node, 1))
                break
            if isinstance(previous, int) and len(at[node]) == 1:
                h = at[node][0]
            else:
                h = cp.new_bool_var(f"held[{s},{node}]")
                for reason in at[node] + ([] if isinstance(previous, int) else [previous]):
                    cp.add_implication(reason, h)
            chain.append((node, h))
            previous = h
        held[int(s)] = chain
    return held


def _held_items(model: MemoryModel, variables: _Vars) -> list:
    """``(node, bytes, expr)`` items whose sum over ``node <= t`` is the bytes of kept storages alive at
    backward node t: each chain of ``held`` as its increments."""
    items = []
    for s, chain in variables.held.items():
        previous = 0
        for node, h in chain:
            items.append((node, int(model.size[s]), h if isinstance(previous, int) else h - previous))
            previous = h
    return items


def _held_at(model: MemoryModel, variables: _Vars, s: int, t: int):
    """Whether storage s is alive (kept and held) at backward node t: 0, 1 or a literal."""
    out = 0
    for node, h in variables.held.get(s, ()):
        if node > t:
            break
        out = h
    return out


def _eager(cp, model: MemoryModel, segment: dict, covers: dict, ckpt: list) -> dict:
    """``eager[t]`` for every node with a plan-dependent excess: t is outside every segment and some
    module path around it is not opened (``planner.memory.excess``). ``opened[p]`` is bounded from above
    by what can open it, ``eager[t]`` from below; the forward limits keep the first large and the
    second small, so both take their exact values."""
    if not len(model.excess) or not model.excess.any():
        return {}
    n_chunks = model.n_chunks
    boundary: list[list[cp_model.IntVar]] = [[] for _ in range(n_chunks + 1)]
    for (a, b), var in segment.items():
        boundary[a].append(var)
        boundary[b].append(var)
    opened = {}
    owner = model.regions.chunk_of()
    eager = {}
    for t in np.flatnonzero(model.excess).tolist():  # Python ints
        k = owner[t]
        for p in model.around[t]:
            if p not in opened:
                o = model.openers[p]
                reasons = [v for j in o.cuts for v in boundary[j]]
                reasons += [covers[a, k2] for k1, k2 in o.spans for a in range(k1 + 1) if (a, k2) in covers]
                var = cp.new_bool_var(f"opened[{p}]")
                cp.add(var <= sum(reasons))
                opened[p] = var
        var = cp.new_bool_var(f"eager[{t}]")
        for p in model.around[t]:
            cp.add(var >= 1 - ckpt[k] - opened[p])
        eager[t] = var
    return eager


def _objective(model: MemoryModel, variables: _Vars):
    """Recompute time: forward time of every checkpointed chunk (re-run once in backward), plus
    the fixed cost of each checkpoint call, minus what saves spare, plus SAC's charge: the sum of
    ``planner.memory.simulate.segment_recompute_us`` over the chosen segments, as a linear expression."""
    return (sum(int(model.chunk_cost_us[k]) * var for k, var in enumerate(variables.ckpt))
            + sum((model.segment_cost_us - rerun_skip_us(model, a, b)) * var
                  for (a, b), var in variables.segment.items())
            - objective_relief(model, variables.save)
            + variables.sac)


def _upper_bound(model: MemoryModel) -> int:
    return int(max(model.const_fwd.max(initial=0), model.const_bwd.max(initial=0),
                   model.const_recompute.max(initial=0)) + 2 * model.size.sum() + model.fwd_rise.max(initial=0))


def _add_forward_limits(cp, model: MemoryModel, variables: _Vars, limit) -> None:
    """Forward: at node t, every storage last read before t is alive iff kept."""
    n = model.n_nodes
    fixed = model.size * (model.always_kept & ~model.fwd_fixed)
    const = model.const_fwd + prefix_by(model.last_use + 1, fixed, n)
    # The kept prefix only grows with t, so a limit is implied by any later one with a larger constant
    # (a node's eager excess may or may not be there: the larger value decides).
    excess = {t: int(model.excess[t]) for t in variables.eager}
    upper = const + (model.excess if excess else 0)
    later_max = np.maximum.accumulate(const[::-1])[::-1]
    times = [t for t in range(n) if t == n - 1 or upper[t] > later_max[t + 1]]
    items = [(int(model.last_use[s]) + 1, int(model.size[s]), var) for s, var in variables.kept.items()
             if not model.fwd_fixed[s]]
    items += [(int(model.last_use[s]) + 1, int(model.size[s]), var) for s, _, var in variables.cache or ()]
    kept_at = _prefix(cp, items, times, "fwd_kept")
    for t in times:
        _add_limit(cp, kept_at[t] + int(const[t]) + (excess[t] * variables.eager[t] if t in excess else 0), limit)


def _prefix(cp, items: list, times: list[int], name: str) -> dict:
    """``t -> sum(bytes * expr for (node, bytes, expr) in items if node <= t)`` for each t in ``times``,
    as chained variables (every ``expr`` between 0 and 1)."""
    pending: dict[int, list] = {}
    for at, size, expr in items:
        pending.setdefault(int(at), []).append((size, expr))
    total = int(sum(size for _, size, _ in items))
    out: dict[int, object] = {}
    running, ready = 0, sorted(pending)
    i = 0
    for t in sorted(set(times)):
        terms = []
        while i < len(ready) and ready[i] <= t:
            terms.extend(pending[ready[i]])
            i += 1
        if terms:
            nxt = cp.new_int_var(0, total, f"{name}[{t}]")
            cp.add(nxt == running + sum(c * v for c, v in terms))
            running = nxt
        out[t] = running
    return out


def _add_backward_limits(cp, model: MemoryModel, variables: _Vars, limit, deadline: Deadline | None) -> None:
    """Backward: at node t, kept storages released at or after t, plus what t's segment recomputed;
    and, where a segment is re-run, the same plus the largest allocation of the re-run. Raises NoSolution
    once ``deadline`` has passed (checked once per segment)."""
    n = model.n_nodes
    owner = model.regions.chunk_of() + [-1] * (n - model.regions.end)
    recomputed = recomputed_from(model)
    times = [t for t in range(n) if model.has_bwd[t]]
    reruns = [(var, last) for (a, b), var in variables.segment.items()
              if (last := rerun_chunk(model, a, b)) is not None]
    items = _held_items(model, variables) + [(at, int(model.size[s]), var) for s, at, var in variables.cache or ()]
    kept_at = _prefix(cp, items, times + [int(model.recompute_at[last]) for _, last in reruns], "bwd_kept")
    reliefs = backward_reliefs(model, variables.same, variables.rows) if variables.same else {}
    for t in times:
        k = owner[t]
        bump = sum(int(recomputed[a, t]) * variables.covers[a, k]
                   for a in range(k + 1) if (a, k) in variables.covers and recomputed[a, t]) if k >= 0 else 0
        # what t itself saves is in the measured constant at t, not in the kept prefix
        own = sum(int(model.size[x]) * _held_at(model, variables, x, t) for x in model.own_saved[t])
        relief = sum(reliefs.get(t, ()))
        _add_limit(cp, kept_at[t] - own + int(model.const_bwd[t]) + bump - relief, limit)
    # Re-run of segment [a, b): just before the backward of its last saving node t.
    for (a, b), var in variables.segment.items():
        if deadline is not None and deadline.passed:
            raise NoSolution(Failure.OUT_OF_TIME, "the time limit ran out while CP-SAT's model was built; "
                             "raise time_limit_s", bound_us=0)  # nothing searched: the trivial bound
        last = rerun_chunk(model, a, b)
        if last is None:
            continue
        t = int(model.recompute_at[last])
        if not variables.save:
            fixed_bytes = int(model.const_recompute[last]) + rerun_bytes(model, a, last, b)
            _add_limit(cp, kept_at[t] + fixed_bytes, limit, enforce=[var])
            continue
        for nbytes, relief in rerun_limits(model, a, last, b, variables.save):  # saves shrink the re-run
            fixed_bytes = int(model.const_recompute[last]) + nbytes
            spared = sum(c * variables.save[o] for o, c in relief.items())
            _add_limit(cp, kept_at[t] + fixed_bytes - spared, limit, enforce=[var])


def _add_limit(cp, expr, limit, enforce=None) -> None:
    """``expr <= limit`` (limit an int budget or the peak variable), optionally only if all ``enforce`` hold."""
    if isinstance(expr, int):
        if not isinstance(limit, int):
            ct = cp.add(limit >= expr)
        elif expr > limit:
            cp.add_bool_or([]) if enforce is None else cp.add_bool_or([v.Not() for v in enforce])
            return
        else:
            return
    else:
        ct = cp.add(expr <= limit)
    if enforce:
        ct.only_enforce_if(enforce)


def read_plan(solver: cp_model.CpSolver, variables: _Vars) -> ChunkPlan:
    """The segments chosen in a solved model."""
    return tuple(sorted(ab for ab, var in variables.segment.items() if solver.value(var)))


def read_saves(solver: cp_model.CpSolver, variables: _Vars) -> frozenset:
    """The nodes saved in a solved model."""
    return frozenset(o for o, var in (variables.save or {}).items() if solver.value(var))


def search(model: MemoryModel, budget_bytes: int, *, deadline: Deadline, hint: ChunkPlan | None = None,
           hint_saves: frozenset = frozenset(), workers: int | None = None, dump_path: str | None = None,
           options: SaveOptions | None = None, below_us: int | None = None,
           incumbent: Incumbent | None = None) -> Solution:
    """CP-SAT alone: the least-recompute plan, from an optional hint (a plan and its saves; no dynamic
    programs), until ``deadline`` (building the model counts). ``below_us``: only plans strictly cheaper
    than that count.

    Ctrl-C stops the search cleanly (``run``); the best plan it found goes to ``incumbent`` and the
    KeyboardInterrupt goes on to ``planner.solve.incumbent.interruptible``, which returns that plan.

    Raises:
        NoSolution: infeasible (proven; with ``below_us``: nothing cheaper), or no plan found in time.
        KeyboardInterrupt: Ctrl-C.
    """
    began = time.perf_counter()
    cp, variables, _ = build(model, budget_bytes=budget_bytes, options=options, deadline=deadline)
    if below_us is not None:
        cp.add(_objective(model, variables) <= below_us - 1)
    if dump_path:
        cp.export_to_file(dump_path)
    if hint is not None:
        chosen = set(hint)
        for ab, var in variables.segment.items():
            cp.add_hint(var, ab in chosen)
        for o, var in (variables.save or {}).items():
            cp.add_hint(var, o in hint_saves)
    solver = _solver(deadline.left_s(), workers)
    status, interrupted = run(solver, cp)
    if status == cp_model.INFEASIBLE and not interrupted:
        raise NoSolution(Failure.INFEASIBLE, "no plan fits the budget")
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        if interrupted:
            raise KeyboardInterrupt
        raise NoSolution(Failure.OUT_OF_TIME, f"CP-SAT found no plan in {time.perf_counter() - began:.1f} s "
                         f"(status {solver.status_name(status)}); raise time_limit_s",
                         bound_us=max(0, int(solver.best_objective_bound)))
    plan, saves = read_plan(solver, variables), read_saves(solver, variables)
    timeline = simulate(model, plan, saves, stashes=False)
    if timeline.peak_bytes > budget_bytes:  # the encoding and the simulator must agree
        raise AssertionError(f"solver plan {plan} saving {sorted(saves)} simulates to {timeline.peak_bytes} "
                             f"> budget {budget_bytes}")
    optimal = status == cp_model.OPTIMAL
    found = Solution(plan=plan, status=SolverStatus.OPTIMAL if optimal else SolverStatus.FEASIBLE,
                     recompute_us=timeline.recompute_us, bound_us=int(solver.best_objective_bound),
                     solve_time_s=time.perf_counter() - began, saves=saves)
    if interrupted:
        if incumbent is not None:
            incumbent.offer(found)
        raise KeyboardInterrupt
    return found


def _solver(time_limit_s: float, workers: int | None) -> cp_model.CpSolver:
    """CP-SAT configured for this model: the objective is a weighted sum of booleans, which
    core-based search (max-SAT style) closes fastest; full linearization gives the LP the
    memory constraints. Measured on examples/gpt.py (64 chunks): 3-6 s to prove optimal, against
    5-30 s for the default 8-worker portfolio on 2 cores."""
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit_s)
    solver.parameters.num_workers = workers or 1
    solver.parameters.linearization_level = 2
    solver.parameters.optimize_with_core = True
    return solver


def run(solver: cp_model.CpSolver, cp: cp_model.CpModel) -> tuple[cp_model.CpSolverStatus, bool]:
    """``solver.solve(cp)``'s status, and whether Ctrl-C stopped it.

    CP-SAT's own SIGINT handler (``catch_sigint_signal``) is off: it left SIGINT at the OS default
    when a solve ended, so any later Ctrl-C killed the process outright (no KeyboardInterrupt, no
    ``finally`` blocks; OR-Tools 9.15), and it hid the interruption from the caller. In the
    main thread the solve runs in a helper thread while this one waits, so Ctrl-C raises
    KeyboardInterrupt here as anywhere in Python: the search is stopped and its status (FEASIBLE
    with the best plan found, or UNKNOWN) returned with ``True``, for the caller to keep that plan and
    raise KeyboardInterrupt again. Elsewhere, Ctrl-C is the main thread's business: the solve runs here,
    to its limit.
    """
    solver.parameters.catch_sigint_signal = False
    if threading.current_thread() is not threading.main_thread():
        return solver.solve(cp), False
    done = threading.Event()
    outcome: list[cp_model.CpSolverStatus | BaseException] = []

    def work() -> None:
        try:
            outcome.append(solver.solve(cp))
        except BaseException as exc:
            outcome.append(exc)
        finally:
            done.set()

    thread = threading.Thread(target=work, name="cp-sat", daemon=True)
    thread.start()
    interrupted = False
    while not done.is_set():  # until the solve has returned, however many Ctrl-Cs come: a solve still running
        try:                  # as the interpreter shuts down can end the process in std::terminate (SIGABRT)
            done.wait()
        except KeyboardInterrupt:
            interrupted = True
            solver.stop_search()
    thread.join()
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0], interrupted
