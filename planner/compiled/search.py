"""Probes: the model compiled at each ``activation_memory_budget`` fraction, its peak measured.

A probe is one compilation plus one measured step. Nothing here predicts a compiled peak: inductor
fuses, reorders and reuses buffers, and the partitioner's peak is not monotonic in the fraction
(a smaller fraction can re-run more at once in backward and peak higher), so every fraction is
measured. The probes that fit the budget are then timed against each other, interleaved.
"""

from __future__ import annotations

import enum
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from planner.capture.inputs import Inputs
from planner.capture.step import backward, default_loss, untouched
from planner.common.loop import TrainingLoop
from planner.compat.torch_private import recompile_limits_raised
from planner.compiled.backend import INDUCTOR, CompiledModule, Graphs
from planner.profiling.measure import measure_peak, measure_step_in_loop, step_samples_ms

FRACTIONS = (1.0, 0.8, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0)
"""The ``activation_memory_budget`` fractions probed by default: 1.0 (compile's own partition, the
baseline of ``"NN%"`` budgets) down to 0.0 (save only the graph's inputs)."""


class Source(enum.Enum):
    """What a probe compiles."""

    KNAPSACK = "knapsack"
    """The model, partitioned by compile's own knapsack at ``fraction``."""
    PLAN = "plan"
    """ckplan's eager plan (``optimize``), each segment a ``torch.utils.checkpoint`` region that the
    partitioner keeps (re-run whole in backward), at ``fraction`` outside them."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Probe:
    """One compilation, measured."""

    source: Source
    fraction: float
    peak_bytes: int
    """Measured peak of one training step (allocator events on CPU, ``max_memory_allocated`` on CUDA)."""
    compile_s: float
    """Seconds of the first step, which compiles forward and backward."""
    step_ms: float | None = None
    """Median step time, ms; None when not timed (over the budget)."""
    graphs: Graphs = Graphs.ONE
    """Where dynamo broke the graph (``CompiledModule.graphs``)."""


def probe(model: nn.Module, fraction: float, inputs: Inputs, loss_fn: Callable[[Any], torch.Tensor] | None,
          *, keep_output: bool, source: Source = Source.KNAPSACK, graphs: Graphs = Graphs.ONE,
          backend: str = INDUCTOR, loop: TrainingLoop | None = None) -> tuple[CompiledModule, Probe]:
    """Compiles ``model`` at ``fraction`` (one warm step; ``backend`` as ``CompiledModule`` takes it) and measures
    the peak of the next step: alone, or a step of ``loop`` without its optimizer (``measure_step_in_loop``)."""
    module = CompiledModule(model, fraction, graphs=graphs, backend=backend)
    start = time.perf_counter()
    with untouched(module), _recompile_room(1):
        backward((loss_fn or default_loss)(module(*inputs.args, **inputs.kwargs)))
    compile_s = time.perf_counter() - start
    peak = (measure_peak(module, inputs, loss_fn, keep_output=keep_output) if loop is None
            else measure_step_in_loop(module, inputs, loss_fn, loop=loop))
    return module, Probe(source=source, fraction=fraction, peak_bytes=peak, compile_s=compile_s, graphs=graphs)


def probe_all(model: nn.Module, fractions: Sequence[float], inputs: Inputs,
              loss_fn: Callable[[Any], torch.Tensor] | None, *, keep_output: bool,
              progress: Callable[[str], None] | None = None) -> list[tuple[CompiledModule, Probe]]:
    """``probe`` at each fraction, in order."""
    results = []
    for fraction in fractions:
        if progress is not None:
            progress(f"compile at activation_memory_budget={fraction:g}")
        results.append(probe(model, fraction, inputs, loss_fn, keep_output=keep_output))
    return results


def _recompile_room(entries: int):
    """Frames that start at the model's own graph breaks are shared by every probe, and each probe (a
    backend of its own) adds an entry to their caches: dynamo's recompile limit grows by one per probe
    rather than silently falling back to eager after eight."""
    global _PROBES
    _PROBES += entries
    return recompile_limits_raised(_PROBES)


_PROBES = 0
"""Probes compiled in this process so far."""


def timed(probed: Sequence[tuple[CompiledModule, Probe]], inputs: Inputs,
          loss_fn: Callable[[Any], torch.Tensor] | None, *, runs: int) -> list[Probe]:
    """The probes with their median step time, measured interleaved (a step of each, ``runs`` rounds)."""
    samples = step_samples_ms([module for module, _ in probed], inputs, loss_fn, runs=runs)
    return [replace(p, step_ms=statistics.median(s)) for (_, p), s in zip(probed, samples)]
