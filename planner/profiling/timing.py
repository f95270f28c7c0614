"""The timed passes of the profile: per-node forward/backward time, whole-step time, the fixed
cost of one checkpoint call on the device, and what selective checkpointing adds per op."""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from planner.capture.inputs import Inputs
from planner.capture.step import LossFn, backward, sync
from planner.compat.sac_autocast import autocast_safe
from planner.errors import OptionError
from planner.profiling.runner import StepRunner
from planner.profiling.windows import AllocatorWindows


class Timer(StepRunner):
    """Timed steps: per-node forward and backward wall time, and each step's forward (the loss included) and
    backward; ``windows``, when set, reads the allocator in the next step (``planner.profiling.windows``)."""

    def __init__(self, gm: fx.GraphModule, device: torch.device, *, keep_output: bool = True) -> None:
        super().__init__(gm, device, keep_output=keep_output)
        self._fwd: dict[int, list[float]] = defaultdict(list)
        self._bwd: dict[int, list[float]] = defaultdict(list)
        self._bwd_step: dict[int, float] = defaultdict(float)
        self._bwd_start: dict[int, float] = {}
        self.windows: AllocatorWindows | None = None
        self.samples: list[tuple[float, float]] = []
        """Per step: its forward and backward wall time (ms), the instrumentation included."""
        self._began = self._mid = 0.0

    def step(self, inputs: Inputs, loss_fn: LossFn) -> None:
        self._bwd_step = defaultdict(float)
        windows = self.windows
        with windows.allocator if windows is not None else contextlib.nullcontext():
            sync(self.device)
            self._began = time.perf_counter()
            super().step(inputs, loss_fn)
        self.windows = None  # one step read
        for index, total in self._bwd_step.items():
            self._bwd[index].append(total)

    def before_backward(self) -> None:
        sync(self.device)
        self._mid = time.perf_counter()

    def after_backward(self) -> None:  # the backward synced
        self.samples.append(((self._mid - self._began) * 1e3, (time.perf_counter() - self._mid) * 1e3))

    def around_node(self, index, node, compute, values):
        if self.windows is not None:
            self.windows.forward(index)
        sync(self.device)
        start = time.perf_counter()
        result = compute()
        sync(self.device)
        self._fwd[index].append((time.perf_counter() - start) * 1e3)
        self._hook_backward(index, result)
        return result

    def on_backward(self, index, phase):
        if phase == "pre" and self.windows is not None:
            self.windows.backward(index)
        sync(self.device)
        now = time.perf_counter()
        if phase == "pre":
            self._bwd_start[index] = now
        else:
            self._bwd_step[index] += (now - self._bwd_start.pop(index, now)) * 1e3

    def fwd_ms(self, index: int) -> float:
        """The node's fastest forward over the timed steps (other processes only ever add time), ms."""
        return min(self._fwd[index]) if self._fwd[index] else 0.0

    def bwd_ms(self, index: int) -> float:
        """The node's fastest backward over the timed steps, ms."""
        return min(self._bwd[index]) if self._bwd[index] else 0.0


RUNS_VARIABLE = "CKPLAN_TIMING_RUNS"
"""Environment variable that sets how many timed steps of each kind every profile takes, busy machine or not,
in one round (``Steps.for_machine``) and without warm-up steps for selective checkpointing's cost: fewer profile
faster with noisier times (the test suite takes 1)."""


def _runs_from_environment() -> int | None:
    value = os.environ.get(RUNS_VARIABLE)
    if value is None:
        return None
    if not value.isdigit() or int(value) < 1:
        raise OptionError(f"{RUNS_VARIABLE}={value!r}: set it to a number of timed steps >= 1, or unset it")
    return int(value)


SET_RUNS = _runs_from_environment()
"""``CKPLAN_TIMING_RUNS`` when set (read once, at import), else None."""
TIMING_RUNS = SET_RUNS or 3
"""Timed steps of each kind a profile takes on a quiet machine (twice as many on a busy one: ``cores``)."""
STEADY = 1.5
"""Plain steps whose slowest takes more than this times their fastest were timed on a busy machine: timed again."""
NOISE_MS = 2.0
"""Plain steps that differ by no more than this are steady whatever their ratio (a step of a few ms jitters)."""
ATTEMPTS = 2
"""Rounds of timed steps at most (``time_step``)."""
BUSY_TIMING_S = 0.5
"""On a busy machine, each kind of timed step of a profile runs for at least this long (``time_step``)."""
TIMING_S = 5.0
"""Each kind of timed step of a profile stops after this long once it has run once: a step of seconds (an LSTM
over 512 steps, a 1,000-block chain) varies little against its length, and a profile of a few such steps keeps
planning within a small multiple of the model's own step."""


@dataclass(frozen=True)
class Steps:
    """How many timed steps of each kind a profile takes.

    Attributes:
        runs: steps of each kind at least; each time is the fastest of them.
        min_s: each kind runs for at least this long (more steps of a short one, up to ``MAX_RUNS``).
        max_s: each kind stops after this long once it has run once (fewer steps of a long one).
        attempts: rounds at most; another round is timed while the plain steps' times vary (``time_step``).
    """

    runs: int = TIMING_RUNS
    min_s: float = 0.0
    max_s: float | None = TIMING_S
    attempts: int = ATTEMPTS

    @classmethod
    def for_machine(cls, busy: bool) -> Steps:
        """Twice the steps, for at least ``BUSY_TIMING_S`` each, on a busy machine; ``CKPLAN_TIMING_RUNS`` steps in
        one round wherever it is set."""
        if SET_RUNS is not None:
            return cls(runs=SET_RUNS, min_s=0.0, attempts=1)
        return cls(runs=2 * TIMING_RUNS, min_s=BUSY_TIMING_S) if busy else cls()

    @classmethod
    def lockstep(cls) -> Steps:
        """A count every rank of a tensor-parallel model takes alike, whatever its own clock and load says: its
        forward runs collectives, so a rank that timed one step more than another would wait for it forever."""
        return cls(runs=TIMING_RUNS, min_s=0.0, max_s=None, attempts=1)


QUIET = Steps()
"""The steps of a profile on a quiet machine."""


def time_step(gm: fx.GraphModule, inputs: Inputs, loss_fn: LossFn, device: torch.device,
              steps: Steps = QUIET, windows: AllocatorWindows | None = None,
              keep_output: bool = True) -> tuple[Timer, float, float]:
    """Per-node times (a ``Timer`` over ``steps.runs`` instrumented steps, the first reading the allocator in
    ``windows`` where given: the caller starts it from no gradients; ``keep_output`` as the memory pass ran) and
    the fastest forward and backward ms of ``steps.runs`` plain steps. Each kind of step runs for at least
    ``steps.min_s`` seconds (more steps of a short one, up to ``MAX_RUNS``: on a busy machine, the fastest of
    many short steps is one no other process interrupted) and stops after ``steps.max_s`` once it has run once.
    Where the instrumented steps alone took that long, their own forward and backward times stand for the plain
    steps' (what the instrumentation adds is lost in steps of seconds). Where the plain steps' times vary by
    more than ``STEADY`` (other processes took the cores for part of them), as many again are timed, up to
    ``steps.attempts`` rounds, and each time is the fastest over all rounds; a warning says so when the last
    round varies as much."""
    timer = Timer(gm, device, keep_output=keep_output)
    timer.windows = windows
    samples: list[tuple[float, float]] = []
    for _ in range(steps.attempts):
        began = time.perf_counter()
        repeated(lambda: timer.step(inputs, loss_fn), steps.runs, steps.min_s, steps.max_s)
        long = steps.max_s is not None and time.perf_counter() - began >= steps.max_s
        latest = timer.samples[-1:] if long else plain_step_samples(gm, inputs, loss_fn, device, steps.runs,
                                                                    min_s=steps.min_s, max_s=steps.max_s)
        samples += latest
        totals = [f + b for f, b in latest]
        if long or max(totals) <= STEADY * min(totals) or max(totals) - min(totals) <= NOISE_MS:
            break
    else:
        warnings.warn(f"ckplan: the profiled step took from {min(totals):,.0f} to {max(totals):,.0f} ms from run to "
                      "run: the machine is busy, so the plan's times may be off; profile where nothing else runs and "
                      "plan from the saved profile (planner.profile(...).save(path), then optimize(..., "
                      "profile=planner.load_profile(path)))", stacklevel=2)
    return timer, min(f for f, _ in samples), min(b for _, b in samples)


MAX_RUNS = 64
"""The most steps of one kind ``min_s`` can ask for."""


def repeated(step: Callable[[], Any], runs: int, min_s: float, max_s: float | None = None) -> None:
    """Runs ``step`` ``runs`` times, and on until ``min_s`` seconds have passed (at most ``MAX_RUNS`` times); once
    it has run once, no more after ``max_s`` seconds."""
    started = time.perf_counter()
    done = 0
    while done < max(1, runs) or (time.perf_counter() - started < min_s and done < MAX_RUNS):
        if done and max_s is not None and time.perf_counter() - started >= max_s:
            break
        step()
        done += 1


def plain_step_samples(gm: fx.GraphModule, inputs: Inputs, loss_fn: LossFn, device: torch.device,
                       runs: int, *, min_s: float = 0.0, max_s: float | None = None) -> list[tuple[float, float]]:
    """Forward and backward time (ms) of each of ``runs`` un-instrumented steps of the graph (more, to fill
    ``min_s`` seconds, fewer past ``max_s``: ``repeated``)."""
    samples = []

    def step() -> None:
        sync(device)
        start = time.perf_counter()
        loss = loss_fn(gm(*inputs.args, **inputs.kwargs))
        sync(device)
        mid = time.perf_counter()
        backward(loss)
        sync(device)
        samples.append(((mid - start) * 1e3, (time.perf_counter() - mid) * 1e3))

    repeated(step, runs, min_s, max_s)
    for p in gm.parameters():
        p.grad = None
    return samples


def checkpoint_overhead_ms(device: torch.device, runs: int = 41) -> float:
    """What one non-reentrant ``checkpoint`` call costs beyond re-running its ops: the median
    difference between a checkpointed and a plain tiny step (about 0.1 ms on a 2-core CPU)."""
    from torch.utils.checkpoint import checkpoint

    weight = torch.ones(8, 8, device=device, requires_grad=True)
    x = torch.ones(4, 8, device=device)

    def fn(t: torch.Tensor) -> torch.Tensor:
        return (t @ weight).relu()

    samples: dict[bool, list[float]] = {False: [], True: []}
    for i in range(2 * runs):
        wrapped = bool(i % 2)
        sync(device)
        start = time.perf_counter()
        out = checkpoint(fn, x, use_reentrant=False) if wrapped else fn(x)
        out.sum().backward()
        sync(device)
        samples[wrapped].append((time.perf_counter() - start) * 1e3)
    weight.grad = None
    # a checkpointed step also re-runs fn once: subtract that forward (about a third of a step)
    plain = statistics.median(samples[False])
    return max(0.0, statistics.median(samples[True]) - plain - plain / 3)


def measure_sac_op_us(gm: fx.GraphModule, inputs: Inputs, loss_fn: LossFn, device: torch.device,
                      ops: int, *, step_ms: float = 0.0) -> float | None:
    """``Profile.sac_op_us``: the model's own measurement (``sac_op_overhead_us``; its forwards alone where a plain
    step takes ``step_ms`` past ``SAC_SECONDS``), never below the tiny-op floor on the same device
    (``dispatch_overhead_us``: a noisy machine can make the model's measurement small); None when the model's
    cannot be measured."""
    measured = sac_op_overhead_us(gm, inputs, loss_fn, device, ops, runs=SET_RUNS or SAC_RUNS,
                                  forward_only=step_ms > SAC_SECONDS * 1e3)
    return None if measured is None else max(measured, dispatch_overhead_us(str(device)))


SAC_RUNS = 4
"""Checkpointed steps with and without selective checkpointing's modes ``sac_op_overhead_us`` takes the fastest of."""
SAC_SECONDS = 3.0
"""About the most time those steps take after the warm-up: a step of a 1,000-block chain takes over a second, and
its per-op cost is as well measured by fewer steps (over thousands of ops). Where the warm-up pair alone takes
longer, it is the measurement; where a plain step alone does, only forwards are timed."""


def sac_op_overhead_us(gm: fx.GraphModule, inputs: Inputs, loss_fn: LossFn, device: torch.device, ops: int,
                       runs: int = SAC_RUNS, *, forward_only: bool = False) -> float | None:
    """What selective checkpointing's dispatch modes (caching in forward, cached in the re-run) add per
    ATen op of this graph: the whole graph as one checkpointed segment with SAC (saving nothing) minus
    without, the fastest of ``runs`` steps of each (alternated) minus each other, over its ``ops``. The
    fastest, as ``dispatch_overhead_us`` takes: other processes only ever add time, and a difference of
    medians of a few steps swung from 20 to 190 us/op on a 2-core CPU shared with other work. Measured on the
    model itself: on the GPT example about 3x what tiny Linear+GELU pairs give (more arguments per op).
    ``forward_only`` (steps of seconds): the forwards alone, their difference counted twice (the re-run's mode
    handles each op as the forward's did; a backward of seconds would be timed for nothing). None (not
    measured) when the graph fails as one checkpointed segment (checkpoint raises ``CheckpointError`` on a
    re-run that differs from the forward); any other error propagates."""
    from torch.utils.checkpoint import (
        CheckpointError,
        checkpoint,
        create_selective_checkpoint_contexts,
        noop_context_fn,
    )

    def step(context_fn) -> float:
        sync(device)
        start = time.perf_counter()
        out = checkpoint(gm, *inputs.args, use_reentrant=False, context_fn=context_fn, **inputs.kwargs)
        if not forward_only:
            backward(loss_fn(out))
        del out
        sync(device)
        return (time.perf_counter() - start) * 1e3

    selective = lambda: autocast_safe(*create_selective_checkpoint_contexts(_recompute_all))
    times: dict[Any, list[float]] = {noop_context_fn: [], selective: []}
    try:
        if SET_RUNS is None:  # CKPLAN_TIMING_RUNS asks for speed over precision: no warm-up
            warm = {context_fn: step(context_fn) for context_fn in (noop_context_fn, selective)}
            if sum(warm.values()) > SAC_SECONDS * 1e3:  # steps of seconds: what warming up adds is lost in them
                times = {context_fn: [ms] for context_fn, ms in warm.items()}
                runs = 0
            else:
                runs = max(1, min(runs, int(SAC_SECONDS * 1e3 / sum(warm.values()))))  # a long step: fewer runs
        for i in range(runs):  # alternate which of the pair goes first
            for context_fn in (noop_context_fn, selective) if i % 2 else (selective, noop_context_fn):
                times[context_fn].append(step(context_fn))
    except CheckpointError:  # the graph cannot run as one checkpointed segment: the profile says "not
        return None          # measured" and planning takes the device spec's value (devices.sac_op_cost)
    finally:
        for p in gm.parameters():
            p.grad = None
    once = (min(times[selective]) - min(times[noop_context_fn])) * 1e3 / max(1, ops)
    return max(0.0, 2 * once if forward_only else once)


def _recompute_all(ctx, op, *args, **kwargs):
    """SAC policy that saves nothing: what SAC's modes cost with nothing to cache."""
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.PREFER_RECOMPUTE


@functools.cache
def dispatch_overhead_us(device: str = "cpu") -> float:
    """Time SAC's two dispatch modes add per ATen op of a segment (forward and re-run) on ``device``,
    measured once per process on 16 tiny Linear+GELU pairs: checkpointed with SAC minus without, per op
    dispatched in their forward (views included: the modes see them too). A floor for ``sac_op_us``."""
    from torch import nn
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts, noop_context_fn

    from planner.profiling.memtrack import LiveStorages

    where = torch.device(device)
    with torch.random.fork_rng(devices=[where] if where.type == "cuda" else []):  # the caller's RNG untouched
        torch.manual_seed(0)
        net = nn.Sequential(*[m for _ in range(16) for m in (nn.Linear(8, 8), nn.GELU())]).to(where)
        x = torch.randn(4, 8, device=where, requires_grad=True)
    with LiveStorages(where) as counter:
        counter.trace = []
        net(x)
    ops = len(counter.trace)

    def step(context_fn) -> float:
        sync(where)
        began = time.perf_counter()
        for _ in range(10):
            checkpoint(net, x, use_reentrant=False, context_fn=context_fn).sum().backward()
        sync(where)
        return (time.perf_counter() - began) / 10

    plain, selective = noop_context_fn, (lambda: create_selective_checkpoint_contexts(_recompute_all))
    step(plain), step(selective)
    diff = min(step(selective) for _ in range(3)) - min(step(plain) for _ in range(3))
    return max(0.0, diff * 1e6 / ops)
