"""Which kept activations a plan offloads to host memory to fit the device budget (torch-free).

``choose_offloads`` takes a checkpointing plan whose predicted peak is over the budget and offloads kept
storages until it fits: at each step the largest candidate that lowers the peak where it stands without adding
exposed copy time (else the one that adds the least), with the copies' schedule
(``planner.memory.offload.schedule``) recomputed for every choice, within the host budget.
``planner.planning.offloading`` calls it on the plans of a few budgets above the device's, so that the
solvers choose among keeping, re-running and offloading: a plan that re-runs less and offloads what does
not fit wins when its copies cost less than the re-runs they spare.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.memory.model import ChunkPlan, MemoryModel
from planner.memory.offload import NO_OFFLOADS, HostLink, Offloads, candidates, holding, relief, schedule
from planner.memory.saves import Saves
from planner.memory.simulate import STEP_PHASE, Timeline, simulate

LOOKAHEAD = 8
"""Candidates a step of the greedy tries past the first that lowers the peak, looking for one that adds less exposed
copy time."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadLimits:
    """What bounds the offloads of a plan."""

    link: HostLink
    host_budget_bytes: int | None = None
    """Pinned host bytes the plan may hold (per rank); None: no limit."""
    min_bytes: int
    """Smallest storage offloaded."""


def choose_offloads(model: MemoryModel, plan: ChunkPlan, saves: Saves, budget_bytes: int,
                    limits: OffloadLimits) -> Offloads | None:
    """The offloads that bring ``plan`` under ``budget_bytes`` (``NO_OFFLOADS`` when it fits already), or None
    when no choice of them does."""
    base = simulate(model, plan, saves)
    if base.peak_bytes <= budget_bytes:
        return NO_OFFLOADS
    if base.peak_phase == STEP_PHASE or model.step_bytes > budget_bytes:
        return None
    held = holding(model, plan, saves)
    pool = [int(s) for s in candidates(model, plan, saves, min_bytes=limits.min_bytes, held=held)]
    chosen: list[int] = []
    current, used = NO_OFFLOADS, 0
    phase, node, peak = base.peak_phase, base.peak_node, base.peak_bytes
    while peak > budget_bytes:
        picked, looked = None, 0
        for s in pool:  # largest first; the first that costs no more exposed copy time, else the cheapest of a few
            if picked is not None and looked >= LOOKAHEAD:
                break
            size = int(model.size[s])
            if limits.host_budget_bytes is not None and used + size > limits.host_budget_bytes:
                continue
            if not _counted_at(model, held, s, phase, node):
                continue
            trial = schedule(model, plan, saves, [*chosen, s], limits.link, held)
            if trial is None:
                continue
            trial_phase, trial_node, trial_peak = _peak(model, base, trial)
            if trial_peak < peak or (trial_peak == peak and (trial_phase, trial_node) != (phase, node)):
                if picked is None or trial.exposed_us < picked[1].exposed_us:
                    picked = (s, trial, trial_phase, trial_node, trial_peak)
                if trial.exposed_us <= current.exposed_us:
                    break
            if picked is not None:
                looked += 1
        if picked is None:
            return None
        s, current, phase, node, peak = picked
        chosen.append(s)
        pool.remove(s)
        used += int(model.size[s])
    return current


def _counted_at(model: MemoryModel, held, s: int, phase: str, node: int) -> bool:
    """Whether the timeline counts ``s`` at ``node`` in ``phase``, where offloading it could take it away."""
    if phase == "forward":
        return bool(held.last[s] < node)
    return bool(held.release[s] <= node and held.need[s] < node)


def _peak(model: MemoryModel, base: Timeline, offloads: Offloads) -> tuple[str, int, int]:
    """Phase, node and bytes of the peak of ``base`` with ``offloads`` off the device."""
    fwd_away, bwd_away = relief(model, offloads)
    fwd = base.fwd_bytes - fwd_away
    bwd = np.where(model.has_bwd, base.bwd_bytes - bwd_away, -1)
    f, b = int(fwd.max(initial=0)), int(bwd.max(initial=0))
    if max(f, b) < model.step_bytes:
        return STEP_PHASE, model.n_nodes - 1, model.step_bytes
    if f >= b:
        return "forward", int(fwd.argmax()), f
    return "backward", int(bwd.argmax()), b
