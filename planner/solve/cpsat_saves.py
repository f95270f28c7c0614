"""The CP-SAT side of op-level saves (selective checkpointing): variables, and the terms they add.

``planner.solve.cpsat.build`` calls these when it is given ``SaveOptions``; they encode exactly what
``planner.memory.saves`` adds to ``planner.memory.simulate`` (a test checks ``encoded_peak == simulate`` on random
plans with saves). Torch-free.
"""

from __future__ import annotations

import numpy as np

from planner.memory.model import MemoryModel
from planner.memory.saves import (
    NEVER,
    SaveOptions,
    cached,
    dropped_at,
    pack_chunks,
    partner,
    relief_row,
    rerun_parts,
    until_rerun,
)


def add_saves(cp, model: MemoryModel, options: SaveOptions, ckpt: list, covers: dict) -> tuple[dict, dict]:
    """``save[o]`` per candidate, the user's overrides, and the kept-reasons saves add.

    Returns ``(save, reasons)``: ``save[o]`` is the variable of candidate node o; ``reasons[s]`` the
    save variables that keep storage s."""
    owner = model.regions.chunk_of()
    # save[o]: candidate o's outputs are cached in forward and handed back when its segment re-runs;
    # meaningful only inside a checkpointed chunk.
    save: dict[int, object] = {}
    for o in options.candidates:
        var = cp.new_bool_var(f"save[{o}]")
        cp.add_implication(var, ckpt[owner[o]])
        k, j = owner[partner(model, o)], owner[o]
        if k != j:  # the first saver of o's output shares o's segment (planner.memory.saves.partner)
            cp.add(var <= sum(covers[a, k] for a in range(j + 1) if (a, k) in covers))
        save[o] = var
    # must_save: never re-run (its chunk is not checkpointed, or it is saved); must_recompute: re-run.
    for o in options.must_save:
        if o < len(owner):
            cp.add_bool_or([ckpt[owner[o]].Not(), save[o]] if o in save else [ckpt[owner[o]].Not()])
    for o in options.must_recompute:
        cp.add(ckpt[owner[o]] == 1)
        if o in save:
            cp.add(save[o] == 0)
    for o, var in save.items():  # no later segment holds a storage only SAC's cache keeps (planner.memory.saves)
        for s in until_rerun(model, o):
            for w in model.consumer_chunks[s]:
                for a in range(owner[o] + 1, w + 1):
                    if (a, w) in covers:
                        cp.add_implication(var, covers[a, w].Not())
    reasons: dict[int, list] = {}
    for o, var in save.items():
        for s in cached(model, o):
            if model.first_saver[s] < NEVER:
                reasons.setdefault(int(s), []).append(var)
    return save, reasons


def cache_items(model: MemoryModel, save: dict) -> list[tuple[int, int, object]]:
    """``(storage, release, save[o])`` for the cached storages nobody saves: kept from their production
    until the re-run of o's segment, counted from ``release = o + 1`` (``planner.memory.saves.dropped_at``)."""
    return [(int(s), o + 1, var) for o, var in save.items() for s in until_rerun(model, o)]


def relief_rows(model: MemoryModel, save: dict) -> dict[int, np.ndarray]:
    """``planner.memory.saves.relief_row`` of every candidate."""
    return {o: relief_row(model, o) for o in save}


def same_segment(cp, model: MemoryModel, save: dict, covers: dict, rows: dict) -> dict:
    """``x[o, k]``: o is saved and chunk k lies in o's segment (``k >= chunk(o)``), for the chunks
    where o's cached storages would otherwise be counted as recomputed (``rows``: ``relief_rows``)."""
    owner = model.regions.chunk_of()
    out = {}
    for o, var in save.items():
        j = owner[o]
        out[o, j] = var
        for k in range(j + 1, model.n_chunks):
            same = [covers[a, k] for a in range(j + 1) if (a, k) in covers]
            if not same:
                break
            lo, hi = model.regions.bounds(k)
            if not (dropped_at(model, o) and model.recompute_at[k] >= 0) and not rows[o][lo:hi].any():
                continue
            x = cp.new_bool_var(f"same_segment[{o},{k}]")
            cp.add(x <= var)
            cp.add(x <= sum(same))
            cp.add(x >= var + sum(same) - 1)
            out[o, k] = x
    return out


def backward_reliefs(model: MemoryModel, same: dict, rows: dict) -> dict[int, list]:
    """Per backward node t: terms ``bytes * x`` subtracted from its bytes. A save in t's segment hands
    back its cached storage instead of a recomputed copy (``rows[o][t] * same[o, chunk(t)]``), and a
    cached storage nobody saves is gone at t when t comes after o and o's segment re-runs past t
    (``dropped_at(o) * same[o, pack_chunk(t)]``)."""
    owner, pack = model.regions.chunk_of(), pack_chunks(model)
    out: dict[int, list] = {}
    for (o, k), x in same.items():
        lo, hi = model.regions.bounds(k)
        for t in range(max(lo, o), hi):
            if rows[o][t] and model.has_bwd[t]:
                out.setdefault(t, []).append(int(rows[o][t]) * x)
        b = dropped_at(model, o)
        if k != owner[o] or not b:
            continue
        for t in range(o + 1, model.regions.end):
            if pack[t] < 0 or (o, int(pack[t])) not in same:
                break
            if model.has_bwd[t]:
                out.setdefault(t, []).append(b * same[o, int(pack[t])])
    return out


def rerun_limits(model: MemoryModel, a: int, last: int, b: int, save: dict) -> list[tuple[int, dict]]:
    """The re-run of segment ``[a, b)`` as ``(bytes, {o: relief})`` pairs: its peak is the largest
    ``bytes - sum(relief[o] * save[o])``. Nodes with the same reliefs are merged (only their largest
    base matters), and pairs another one always dominates are dropped."""
    base, relief, restored = rerun_parts(model, a, last, b, list(save))
    if not relief:
        return [(int(base.max()) + restored, {})]
    keys = sorted(relief)
    matrix = np.stack([relief[o] for o in keys], axis=1)
    groups: dict[tuple, int] = {}
    for i in range(len(base)):
        sig = tuple(int(v) for v in matrix[i])
        groups[sig] = max(groups.get(sig, -(1 << 62)), int(base[i]))
    items = sorted(groups.items(), key=lambda kv: -kv[1])
    kept: list[tuple[tuple, int]] = []
    for sig, value in items:
        # dominated when some kept pair is larger whatever is saved
        if any(v - sum(max(0, c2 - c1) for c1, c2 in zip(sig, s2)) >= value for s2, v in kept):
            continue
        kept.append((sig, value))
    return [(value + restored, {o: c for o, c in zip(keys, sig) if c}) for sig, value in kept]


def objective_relief(model: MemoryModel, save: dict):
    """Forward time the saves spare the re-runs, microseconds (subtracted from the objective)."""
    return sum(int(model.node_cost_us[o]) * var for o, var in save.items())


def sac_overhead(cp, model: MemoryModel, save: dict, covers: dict):
    """Time SAC's dispatch modes add to the segments with saves, as an objective term.

    ``uses_sac[a]``: the segment starting at chunk a saves something; ``sac_chunk[k]``: chunk k lies in
    such a segment. Both only bounded from below: the objective keeps them as small as allowed."""
    if not save or not len(model.sac_chunk_us) or not model.sac_chunk_us.any():
        return 0
    owner = model.regions.chunk_of()
    uses = {}
    for o, var in save.items():
        j = owner[o]
        for a in range(j + 1):
            if (a, j) in covers:
                if a not in uses:
                    uses[a] = cp.new_bool_var(f"uses_sac[{a}]")
                cp.add(uses[a] >= covers[a, j] + var - 1)
    terms = []
    for k in range(model.n_chunks):
        if not model.sac_chunk_us[k]:
            continue
        reach = [a for a in uses if (a, k) in covers]
        if reach:
            w = cp.new_bool_var(f"sac_chunk[{k}]")
            for a in reach:
                cp.add(w >= covers[a, k] + uses[a] - 1)
            terms.append(int(model.sac_chunk_us[k]) * w)
    return sum(terms)
