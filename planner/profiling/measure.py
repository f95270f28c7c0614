"""Measures what one real training step of any module costs: peak memory and time.

The check on every prediction. Peaks are read at the device's allocator (``planner.profiling.allocator``), where
memory runs out: on CPU torch.profiler's memory events (every allocation and free, also those an op makes inside
itself), on CUDA ``torch.cuda.max_memory_allocated``. The module's gradients, buffers and RNG state are restored
afterwards.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from planner.capture.inputs import Inputs
from planner.capture.step import LossFn, backward, default_loss, untouched
from planner.capture.step import sync as _sync
from planner.common.loop import Gradients, TrainingLoop, ZeroGrad
from planner.compat.torch_private import storage_id, tree_leaves
from planner.profiling.allocator import AllocatorTrace
from planner.profiling.memtrack import LiveStorages


@dataclass(frozen=True, kw_only=True, slots=True)
class Measurement:
    """One module's measured training step."""

    peak_bytes: int
    """Peak bytes allocated on the device during forward + backward (parameters included)."""
    step_ms: float
    """Median wall time of a step (forward, loss, backward), ms."""


def measure_peak(module: nn.Module, inputs: Inputs, loss_fn: Callable[[Any], torch.Tensor] | None = None, *,
                 keep_output: bool = True) -> int:
    """Peak bytes of one training step at the device's allocator, starting with no gradients allocated.

    The step is ``output = module(*inputs); backward(loss_fn(output))`` with ``output``
    referenced until backward ends, as in the usual training loop; with ``keep_output=False`` it
    is dropped before backward, as Hugging Face Trainer's ``compute_loss`` does. On CPU: the storages of the
    parameters, buffers and inputs alive before the step plus the highest rise of the allocator during it (every
    allocation and free, so gradients, workspaces ops allocate inside themselves and compiled kernels' buffers
    included); on CUDA ``max_memory_allocated``."""
    device = next(module.parameters()).device
    with untouched(module), AllocatorTrace(device) as trace:
        run_step(module, inputs, loss_fn, keep_output=keep_output)
    return _before(trace, _resident(module, inputs)) + trace.peak_bytes


def measure_live_peak(module: nn.Module, inputs: Inputs, loss_fn: Callable[[Any], torch.Tensor] | None = None, *,
                      keep_output: bool = True) -> int:
    """Peak bytes of the step ``measure_peak`` runs as the dispatcher sees it: the live storages ops return
    (``LiveStorages``), without what ops allocate inside themselves. For comparing the two rulers."""
    return _live_step(module, inputs, loss_fn, keep_output=keep_output).peak_bytes


def allocation_events(module: nn.Module, inputs: Inputs, loss_fn: Callable[[Any], torch.Tensor] | None = None, *,
                      keep_output: bool = True) -> list[tuple[int, int]]:
    """The allocations and frees of the step ``measure_peak`` runs, as the dispatcher sees them (``LiveStorages``:
    what ops allocate inside themselves is not in it), the parameters, buffers and inputs first: ``(key, bytes)``
    for an allocation, ``(key, 0)`` for its free, in order (what ``planner.memory.caching.simulate_reserved``
    replays)."""
    events = _live_step(module, inputs, loss_fn, keep_output=keep_output, events=True).events
    assert events is not None  # asked for
    return events


def _live_step(module: nn.Module, inputs: Inputs, loss_fn: Callable[[Any], torch.Tensor] | None, *,
               keep_output: bool, events: bool = False) -> LiveStorages:
    """The step ``measure_peak`` runs under ``LiveStorages`` (recording its events when asked), the parameters,
    buffers and inputs counted first."""
    tracker = LiveStorages(next(module.parameters()).device)
    if events:
        tracker.events = []
    for t in _resident(module, inputs):
        tracker.track(t)
    with untouched(module), tracker:
        run_step(module, inputs, loss_fn, keep_output=keep_output)
    return tracker


def _before(trace: AllocatorTrace, tensors: Sequence[torch.Tensor]) -> int:
    """What the device held when ``trace`` began: the allocator's own count where it keeps one (CUDA), else the
    distinct storages of ``tensors`` on the device (the CPU allocator serves the whole process)."""
    if trace.base_bytes is not None:
        return trace.base_bytes
    return sum({storage_id(t.untyped_storage()): t.untyped_storage().nbytes()
                for t in tensors if t.device == trace.device}.values())


def measure_loop_peak(module: nn.Module, batches: Sequence[Inputs], loss_fn: LossFn | None = None, *,
                      loop: TrainingLoop, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Peak bytes of the training loop ``loop`` describes, run for real over ``batches`` (one per micro-step), from
    no gradients and no optimizer state: ``optimizer.step()`` after every ``loop.gradient_accumulation_steps``
    micro-steps, gradients cleared (``set_to_none`` as the loop says) before the first micro-step's forward or, for
    ``ZeroGrad.BEFORE_BACKWARD``, right before its backward, the output kept through backward (and the optimizer's
    step) when the loop keeps it, released at the end of each micro-step; forward and loss under the loop's
    autocast, backward outside it. Read at the device's allocator (as ``measure_peak``): parameters, buffers,
    gradients, optimizer state, everything the loop allocates, and each batch from its micro-step on, or from the
    first of the ``loop.batches_held`` taken together (pass one batch object repeated to count one, as a loader
    that makes each batch in turn holds; k distinct ones repeated for a loop that holds k). The module's
    parameters train: pass a copy to keep the model as it was."""
    device = next(module.parameters()).device
    every, held = loop.gradient_accumulation_steps, loop.batches_held
    counted: dict[int, int] = {}  # storage -> bytes, of the batches counted so far
    batch_bytes: list[int] = []  # per window: bytes of the batches counted when it opened

    def clear() -> None:
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=loop.set_to_none)
        else:
            module.zero_grad(set_to_none=loop.set_to_none)

    def run(trace: AllocatorTrace) -> None:
        for i, inputs in enumerate(batches):
            if i % held == 0:  # counted from its micro-step on (the caller holds it after), with the others the
                for batch in batches[i:i + held]:  # loop holds at once
                    for t in tree_leaves((batch.args, batch.kwargs)):
                        if isinstance(t, torch.Tensor) and t.device == device:
                            counted[storage_id(t.untyped_storage())] = t.untyped_storage().nbytes()
            trace.mark()
            batch_bytes.append(sum(counted.values()))
            first = i % every == 0
            if first and loop.zero_grad is ZeroGrad.BEFORE_FORWARD:
                clear()
            with autocast():  # forward and loss; backward outside, as torch recommends and the stacks run it
                output = module(*inputs.args, **inputs.kwargs)
                loss = (loss_fn or default_loss)(output)
            if not loop.keep_output:
                output = None
            if first and loop.zero_grad is ZeroGrad.BEFORE_BACKWARD:
                clear()
            backward(loss)
            if (i + 1) % every == 0 and optimizer is not None:
                optimizer.step()
            del loss, output

    dtype = loop.autocast_dtype

    def autocast() -> contextlib.AbstractContextManager:
        return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()

    module.train()
    for p in module.parameters():
        p.grad = None
    with AllocatorTrace(device) as trace:
        run(trace)
    if trace.base_bytes is not None:  # the allocator counted the batches already there
        return trace.base_bytes + trace.peak_bytes
    before = _before(trace, [*module.parameters(), *module.buffers()])
    return before + max(w.peak_bytes + b for w, b in zip(trace.windows, batch_bytes))


def measure_step_in_loop(module: nn.Module, inputs: Inputs, loss_fn: LossFn | None = None, *,
                         loop: TrainingLoop) -> int:
    """Peak bytes of a step of ``loop`` at the allocator, without its optimizer (no state, no step): as many
    micro-steps on ``inputs`` as it takes for earlier gradients to be alive as the loop keeps them (two where the
    last step's gradients live into the next forward or are zeroed in place, the micro-steps of an optimizer step
    where they accumulate; one where each step starts without them). The module's gradients, buffers and RNG state
    are restored afterwards."""
    micro = 1 if loop.gradients is Gradients.NONE else max(2, loop.gradient_accumulation_steps)
    with untouched(module):
        return measure_loop_peak(module, [inputs] * micro, loss_fn, loop=replace(loop, optimizer=None))


def run_step(module: nn.Module, inputs: Inputs, loss_fn: Callable[[Any], torch.Tensor] | None, *,
          keep_output: bool) -> None:
    """One measured step: the output kept alive through backward, as a training loop does, unless
    ``keep_output`` is False."""
    output = module(*inputs.args, **inputs.kwargs)
    loss = (loss_fn or default_loss)(output)
    if not keep_output:
        output = None
    backward(loss)
    del loss, output


def _resident(module: nn.Module, inputs: Inputs) -> list[torch.Tensor]:
    """The tensors alive before a step: parameters, buffers and inputs."""
    return [t for t in [*module.parameters(), *module.buffers(), *tree_leaves((inputs.args, inputs.kwargs))]
            if isinstance(t, torch.Tensor)]


def step_times_ms(modules: Sequence[nn.Module], inputs: Inputs, loss_fn: Callable[[Any], torch.Tensor] | None = None,
                  *, runs: int = 5) -> list[float]:
    """Median step time of each module, measured interleaved (a step of each, ``runs`` times)."""
    return [statistics.median(s) for s in step_samples_ms(modules, inputs, loss_fn, runs=runs)]


def step_samples_ms(modules: Sequence[nn.Module], inputs: Inputs, loss_fn: Callable[[Any], torch.Tensor] | None = None,
                    *, runs: int = 5) -> list[list[float]]:
    """Step times of each module, ms: ``runs`` rounds of one step of each module in turn, after one round
    of warm-up (a slow drift of a shared machine hits every module alike)."""
    loss_fn = loss_fn or default_loss
    samples: list[list[float]] = [[] for _ in modules]
    contexts = [untouched(m) for m in modules]
    for ctx in contexts:
        ctx.__enter__()
    try:
        for _ in range(runs + 1):  # the first round warms up
            for i, module in enumerate(modules):
                device = next(module.parameters()).device
                _sync(device)
                start = time.perf_counter()
                backward(loss_fn(module(*inputs.args, **inputs.kwargs)))
                _sync(device)
                samples[i].append((time.perf_counter() - start) * 1e3)
                for p in module.parameters():
                    p.grad = None
    finally:
        for ctx in reversed(contexts):
            ctx.__exit__(None, None, None)
    return [s[1:] for s in samples]


def measure(module: nn.Module, inputs: Inputs, loss_fn: Callable[[Any], torch.Tensor] | None = None,
            *, runs: int = 5) -> Measurement:
    """Peak memory of one step and median time of ``runs`` steps."""
    return Measurement(peak_bytes=measure_peak(module, inputs, loss_fn),
                       step_ms=step_times_ms([module], inputs, loss_fn, runs=runs)[0])
