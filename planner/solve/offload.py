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
from typing import Protocol

import numpy as np

from planner.memory.model import ChunkPlan, MemoryModel
from planner.memory.offload import NO_OFFLOADS, Holding, HostLink, Offloads, candidates, holding, relief, schedule
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


Peak = tuple[str, int, int]
"""Phase, node and bytes of a peak."""


class Ruler(Protocol):
    """Where a plan with offloads peaks: the step's own timeline (``StepRuler``), or what holds it beside (a
    pipeline stage's other microbatches in flight, ``planner.planning.pipelined``)."""

    def peak(self, offloads: Offloads) -> Peak:
        """The peak with ``offloads`` off the device."""

    def lowers(self, s: int, phase: str, node: int) -> bool:
        """Whether offloading storage ``s`` can lower a peak at ``node`` in ``phase``."""


class StepRuler:
    """The step's peak: its timeline with the offloaded storages off the device where the copies take them."""

    def __init__(self, model: MemoryModel, base: Timeline, held: Holding) -> None:
        self.model, self.base, self.held = model, base, held

    def peak(self, offloads: Offloads) -> Peak:
        return _peak(self.model, self.base, offloads)

    def lowers(self, s: int, phase: str, node: int) -> bool:
        return _counted_at(self.model, self.held, s, phase, node)


def choose_offloads(model: MemoryModel, plan: ChunkPlan, saves: Saves, budget_bytes: int,
                    limits: OffloadLimits, ruler: Ruler | None = None) -> Offloads | None:
    """The offloads that bring ``plan`` under ``budget_bytes`` (``NO_OFFLOADS`` when it fits already), or None
    when no choice of them does; the peak as ``ruler`` reads it (default the step's, ``StepRuler``)."""
    held = holding(model, plan, saves)
    ruler = ruler or StepRuler(model, simulate(model, plan, saves), held)
    phase, node, peak = ruler.peak(NO_OFFLOADS)
    if peak <= budget_bytes:
        return NO_OFFLOADS
    if phase == STEP_PHASE or model.step_bytes > budget_bytes:
        return None
    pool = [int(s) for s in candidates(model, plan, saves, min_bytes=limits.min_bytes, held=held)]
    chosen: list[int] = []
    current, used = NO_OFFLOADS, 0
    while peak > budget_bytes:
        picked, looked = None, 0
        for s in pool:  # largest first; the first that costs no more exposed copy time, else the cheapest of a few
            if picked is not None and looked >= LOOKAHEAD:
                break
            size = int(model.size[s])
            if limits.host_budget_bytes is not None and used + size > limits.host_budget_bytes:
                continue
            if not ruler.lowers(s, phase, node):
                continue
            trial = schedule(model, plan, saves, [*chosen, s], limits.link, held)
            if trial is None:
                continue
            trial_phase, trial_node, trial_peak = ruler.peak(trial)
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


def _counted_at(model: MemoryModel, held: Holding, s: int, phase: str, node: int) -> bool:
    """Whether the timeline counts ``s`` at ``node`` in ``phase``, where offloading it could take it away."""
    if phase == "forward":
        return bool(held.last[s] < node)
    return bool(held.release[s] <= node and held.need[s] < node)


def relieved(model: MemoryModel, base: Timeline, offloads: Offloads) -> tuple[np.ndarray, np.ndarray]:
    """``base``'s forward and backward bytes per node with ``offloads`` off the device (-1: no backward)."""
    fwd_away, bwd_away = relief(model, offloads)
    return base.fwd_bytes - fwd_away, np.where(model.has_bwd, base.bwd_bytes - bwd_away, -1)


def _peak(model: MemoryModel, base: Timeline, offloads: Offloads) -> Peak:
    """Phase, node and bytes of the peak of ``base`` with ``offloads`` off the device."""
    fwd, bwd = relieved(model, base, offloads)
    f, b = int(fwd.max(initial=0)), int(bwd.max(initial=0))
    if max(f, b) < model.step_bytes:
        return STEP_PHASE, model.n_nodes - 1, model.step_bytes
    if f >= b:
        return "forward", int(fwd.argmax()), f
    return "backward", int(bwd.argmax()), b
