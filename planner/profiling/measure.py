"""Measures what one real training step of any module costs: peak memory and time.

The check on every prediction. On CPU the peak is counted by ``LiveStorages``
(the same ruler the profiler uses); on CUDA it is ``torch.cuda.max_memory_allocated``.
The module's gradients, buffers and RNG state are restored afterwards.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from planner.capture.inputs import Inputs
from planner.capture.step import LossFn, backward, default_loss, untouched
from planner.capture.step import sync as _sync
from planner.common.loop import TrainingLoop, ZeroGrad
from planner.compat.torch_private import storage_id, tree_leaves
from planner.profiling.memtrack import LiveStorages


@dataclass(frozen=True, kw_only=True, slots=True)
class Measurement:
    """One module's measured training step."""

    peak_bytes: int
    """Peak live bytes on the device during forward + backward (parameters included)."""
    step_ms: float
    """Median wall time of a step (forward, loss, backward), ms."""


def measure_peak(module: nn.Module, inputs: Inputs, loss_fn: Callable[[Any], torch.Tensor] | None = None, *,
                 keep_output: bool = True) -> int:
    """Peak bytes of one training step, starting with no gradients allocated.

    The step is ``output = module(*inputs); backward(loss_fn(output))`` with ``output``
    referenced until backward ends, as in the usual training loop; with ``keep_output=False`` it
    is dropped before backward, as Hugging Face Trainer's ``compute_loss`` does."""
    device = next(module.parameters()).device
    with untouched(module):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            _step(module, inputs, loss_fn, keep_output=keep_output)
            torch.cuda.synchronize(device)
            return torch.cuda.max_memory_allocated(device)
        tracker = LiveStorages(device)
        for t in _resident(module, inputs):
            tracker.track(t)
        with tracker:
            _step(module, inputs, loss_fn, keep_output=keep_output)
        return tracker.peak_bytes


def measure_loop_peak(module: nn.Module, batches: Sequence[Inputs], loss_fn: LossFn | None = None, *,
                      loop: TrainingLoop, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Peak bytes of the training loop ``loop`` describes, run for real over ``batches`` (one per micro-step), from
    no gradients and no optimizer state: ``optimizer.step()`` after every ``loop.gradient_accumulation_steps``
    micro-steps, gradients cleared (``set_to_none`` as the loop says) before the first micro-step's forward or, for
    ``ZeroGrad.BEFORE_BACKWARD``, right before its backward, the output kept through backward (and the optimizer's
    step) when the loop keeps it, released at the end of each micro-step; forward and loss under the loop's
    autocast, backward outside it. On CUDA the allocator's peak, else the live storages: parameters, buffers,
    gradients, optimizer state, everything the loop allocates, and each batch from its micro-step on, or from the
    first of the ``loop.batches_held`` taken together (pass one batch object repeated to count one, as a loader
    that makes each batch in turn holds; k distinct ones repeated for a loop that holds k). The module's
    parameters train: pass a copy to keep the model as it was."""
    device = next(module.parameters()).device
    every, held = loop.gradient_accumulation_steps, loop.batches_held

    def clear() -> None:
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=loop.set_to_none)
        else:
            module.zero_grad(set_to_none=loop.set_to_none)

    def run() -> None:
        for i, inputs in enumerate(batches):
            if tracker is not None and i % held == 0:  # counted from its micro-step on (the caller holds it after),
                for batch in batches[i:i + held]:     # with the others the loop holds at once
                    for t in tree_leaves((batch.args, batch.kwargs)):
                        if isinstance(t, torch.Tensor):
                            tracker.track(t)
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
    tracker = None if device.type == "cuda" else LiveStorages(device)
    if tracker is None:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        run()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    for t in [*module.parameters(), *module.buffers()]:
        tracker.track(t)
    with tracker:
        run()
    return tracker.peak_bytes


def _step(module: nn.Module, inputs: Inputs, loss_fn: Callable[[Any], torch.Tensor] | None, *,
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


def measure_allocated_peak(module: nn.Module, inputs: Inputs, loss_fn: Callable[[Any], torch.Tensor] | None = None,
                           *, keep_output: bool = True) -> int:
    """Peak bytes of one training step counted at the allocator: the ruler for compiled modules, whose
    kernels allocate below the dispatcher where ``LiveStorages`` cannot see them.

    On CUDA it is ``measure_peak`` (``max_memory_allocated`` already counts every allocation). On CPU
    it is the storages of the parameters, buffers and inputs alive before the step plus the highest
    running sum of torch.profiler's memory events during it (every allocation and free of the CPU
    allocator, so gradients, compiled buffers and workspaces included). The step is as in
    ``measure_peak``."""
    from torch.profiler import ProfilerActivity, profile

    device = next(module.parameters()).device
    if device.type == "cuda":
        return measure_peak(module, inputs, loss_fn, keep_output=keep_output)
    resident = {storage_id(t.untyped_storage()): t.untyped_storage().nbytes()
                for t in _resident(module, inputs) if t.device == device}
    with untouched(module), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _step(module, inputs, loss_fn, keep_output=keep_output)
    events = sorted((e for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return sum(resident.values()) + peak
