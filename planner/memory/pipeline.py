"""A pipeline-parallel stage's memory: how many microbatches' activations its schedule keeps alive at once
(torch-free).

Under pipeline parallelism a stage does not hold one step: its schedule runs the forwards of several microbatches
before the backward of the first. At the stage's peak, ``in_flight`` microbatches have run their forward and not
their backward: one is in its own step (forward or backward, the peak of one microbatch's step, which the memory
model predicts for any plan), and the others hold what their forward left for backward. That is the activations
the plan keeps (``kept_bytes``: a linear function of the plan) plus the stage's input (received from the stage
before, kept for the gradient sent back to it) and its output (kept until its gradient comes back). So

    stage peak = one microbatch's step peak + (in_flight - 1) x (kept(plan) + input + output)

in two phases: until the stage's first backward has run, with no gradients yet (``in_flight``); after it, with
the gradients the microbatches accumulate into alive throughout the step (``in_flight_after_first_backward``).

The counts follow ``torch.distributed.pipelining``'s schedules (and Megatron's, which agree):

- **GPipe**: every forward, then every backward: all ``m`` microbatches.
- **1F1B**: stage ``i`` of ``p`` runs ``min(m, p - i)`` forwards before its first backward, then one backward and
  one forward in turn: the first stage holds the most, the last one.
- **Interleaved 1F1B** (``v`` model chunks per rank, rank ``r``): ``min((v - 1) p + 2 (p - 1 - r) + 1, m v)``
  chunk-microbatches (torch's ``_get_warmup_ops`` with ``microbatches_per_round = p``, plus the forward that starts
  the steady phase), of the rank's ``v`` chunks together.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from planner.common.units import format_bytes
from planner.memory.model import ChunkPlan, MemoryModel
from planner.memory.release import release_of
from planner.memory.saves import Saves, kept_by_saves
from planner.memory.simulate import kept_storages, stashed_bytes


class Schedule(enum.Enum):
    """The order a pipeline runs its microbatches' forwards and backwards in."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved_1f1b"


@dataclass(frozen=True, kw_only=True, slots=True)
class Pipeline:
    """A pipeline-parallel job's layout: ``stages`` ranks in a pipeline (``p``), each step split into
    ``microbatches`` (``m``), ``chunks`` model pieces per rank (``v``, interleaved schedules only)."""

    schedule: Schedule
    stages: int
    microbatches: int
    chunks: int = 1

    def __post_init__(self) -> None:
        for name in ("stages", "microbatches", "chunks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"a pipeline's {name} must be an integer >= 1, got {value!r}")
        if self.chunks > 1 and self.schedule is not Schedule.INTERLEAVED_1F1B:
            raise ValueError(f"{self.chunks} chunks per rank need the interleaved schedule, not {self.schedule.value}")

    def in_flight(self, rank: int) -> int:
        """Microbatches (chunk-microbatches, for an interleaved schedule) whose forward has run and whose backward
        has not, at once at the peak of pipeline rank ``rank`` (0 is the first stage)."""
        if not 0 <= rank < self.stages:
            raise ValueError(f"pipeline rank {rank} is not one of the {self.stages} stages (0 to {self.stages - 1})")
        p, m, v = self.stages, self.microbatches, self.chunks
        if self.schedule is Schedule.GPIPE:
            return m
        if self.schedule is Schedule.ONE_F_ONE_B:
            return min(m, p - rank)
        return min((v - 1) * p + 2 * (p - 1 - rank) + 1, m * v)

    def in_flight_after_first_backward(self, rank: int) -> int:
        """``in_flight`` once the rank's first backward has run (the gradients exist from then on): as many where
        forwards remain after it (a forward follows each backward), one fewer where none do (GPipe, and 1F1B with
        no more microbatches than the warm-up takes)."""
        most = self.in_flight(rank)
        return most if self.microbatches * self.chunks > most else max(most - 1, 1)

    def sends_held(self, rank: int) -> int:
        """Outputs kept past their own backward, from the rank's first backward on: torch's ``Schedule1F1B`` keeps
        the work of the last warm-up send it fires (microbatch ``w - 2`` of ``w`` warm-up forwards) in a local until
        its cool-down begins, and the work keeps that output; it outlives the output's backward when a backward
        follows it before the cool-down (``m >= 2 w - 1``). 1 there on every stage but the last (which sends no
        output; measured on the first and the third of 4 stages and the first of 2, 32 KiB each), else 0."""
        warmup = self.in_flight(rank)
        sends = rank < self.stages - 1 and self.schedule is Schedule.ONE_F_ONE_B
        return int(sends and warmup >= 2 and self.microbatches >= 2 * warmup - 1)


@dataclass(frozen=True, kw_only=True, slots=True)
class StagePeak:
    """What a pipeline stage holds at its peak besides one microbatch's step."""

    rank: int
    """The stage's place in the pipeline (0: the first)."""
    in_flight: int
    """Microbatches between their forward and their backward at once (``Pipeline.in_flight``)."""
    per_microbatch_bytes: int
    """What each of the others holds: the activations the plan keeps and the stage's output."""
    buffers_bytes: int
    """What the pipeline's runtime holds for the step's other microbatches, whatever the plan: their inputs
    (received activations, or the batch split up front) and the output gradients it receives into."""
    peak_bytes: int
    """The stage's predicted peak."""
    baseline_peak_bytes: int
    """The stage's predicted peak without checkpointing (what ``"NN%"`` budgets of a stage are of)."""
    host_bytes: int = 0
    """Host memory the plan's offloads hold at the stage's peak: a copy for each microbatch in flight."""

    def text(self) -> str:
        flight = f"{self.in_flight} microbatch{'es' if self.in_flight > 1 else ''} in flight"
        others = f", each other one holding {format_bytes(self.per_microbatch_bytes)}" if self.in_flight > 1 else ""
        host = f" ({format_bytes(self.host_bytes)} offloaded to host memory)" if self.host_bytes else ""
        return (f"pipeline stage {self.rank}: {flight}{others}; the stage peaks at "
                f"{format_bytes(self.peak_bytes)}{host}")


def kept_bytes(model: MemoryModel, plan: ChunkPlan, saves: Saves = frozenset()) -> int:
    """Bytes a microbatch's forward leaves alive for its backward under ``plan``: the activations the plan keeps
    (those of its segments' kept ops too) and the random-number state its segments stash (the most at once);
    beside the step's plan-independent bytes (parameters, the loop's) and its inputs."""
    kept = kept_storages(model, plan)
    if saves:
        kept = kept | kept_by_saves(model, saves, release_of(model, plan))[0]
    kept &= model.producer >= 0  # the step's inputs are the stage's, counted apart
    return int((model.size * kept).sum()) + int(stashed_bytes(model, plan).max(initial=0))


def stage_peak(step_peak: int, in_flight: int, per_microbatch: int) -> int:
    """A stage's peak: one microbatch's step at ``step_peak`` with ``in_flight - 1`` others each holding
    ``per_microbatch`` bytes (what its forward kept, and the stage's input and output)."""
    return step_peak + (in_flight - 1) * per_microbatch
