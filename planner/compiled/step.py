"""Plans for a training step that runs under ``torch.compile`` (``compile_backend``): fitted to the compiled step,
as measured at this device's allocator.

The eager memory model does not describe a compiled step (``planner.compiled.fit``), so a plan whose step the user
(or Trainer, accelerate, Lightning) compiles is compiled here first, with the same backend, and its step measured;
the plan is solved again at other eager budgets until the compiled step fits (``fit_compiled``). The measured step
is a step of the loop without its optimizer (``measure_step_in_loop``: the earlier gradients alive as the loop
keeps them, the output kept or dropped, under its autocast); what the optimizer and the loader keep besides it (the
optimizer's state, the micro-batches held together) is added as bytes no plan changes (``loop_bytes``), and the
optimizer's own step after backward, whose peak no plan changes either, is the eager model's
(``MemoryModel.step_bytes``). ``"NN%"`` budgets are of the un-checkpointed step
compiled the same way.

Only the graph breaks a plan's module carries are tried: one graph, or the input embedding apart (a hook on the
planned module). Breaking the graph at each checkpointed layer is a process-wide setting of dynamo
(``Graphs.PER_REGION``), which a model compiled by someone else does not get.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace

import torch
from torch import nn

from planner.common.budget import is_device_budget, parse_budget
from planner.compiled.backend import Graphs, input_embedding
from planner.compiled.fit import fit_compiled
from planner.compiled.search import probe
from planner.errors import CompileError, InfeasibleBudget, PlannerError
from planner.pipeline import plan_for
from planner.plan import CompiledStep, Plan
from planner.planning.prepared import Prepared, device_bytes
from planner.rewrite.modules import break_graph_after


def fit_step(prepared: Prepared, budget: int | str, *, target: nn.Module | None = None) -> Plan:
    """The plan of ``prepared`` (made with ``compile_backend``) whose compiled step, measured, fits ``budget``,
    with ``compiled_step`` saying what it measured; on ``target`` in place as ``plan_for`` puts it.

    Raises:
        InfeasibleBudget: no plan's compiled step fits (carrying the least measured), or the optimizer's step
            alone does not.
        CompileError: the model, or a plan of it, does not compile with the backend.
    """
    opts = prepared.options
    backend = opts.compile_backend
    if backend is None:
        raise ValueError("fit_step plans a step compiled with compile_backend=; plan_for plans the eager one")
    extra = loop_bytes(prepared)
    with _as_trained(prepared), _compiles(backend, "the model"):
        _, plain = probe(prepared.model, 1.0, prepared.example, opts.loss_fn, keep_output=opts.keep_output,
                         backend=backend, loop=prepared.loop)
    baseline_bytes = plain.peak_bytes + extra
    budget_bytes = parse_budget(budget, baseline_peak_bytes=baseline_bytes,
                                device_bytes=device_bytes(prepared) if is_device_budget(budget) else None)
    optimizer_bytes = prepared.memory.step_bytes
    if optimizer_bytes > budget_bytes:
        raise InfeasibleBudget(budget_bytes, optimizer_bytes, reason="the optimizer's step after backward")
    if baseline_bytes <= budget_bytes:  # the un-checkpointed step compiled fits: nothing to re-run
        plan = plan_for(prepared, prepared.baseline.peak_bytes, target=target, budget_bounds="allocated")
        return replace(plan, budget_bytes=budget_bytes, compiled_step=CompiledStep(
            backend=backend, peak_bytes=max(baseline_bytes, optimizer_bytes), baseline_peak_bytes=baseline_bytes))
    with _as_trained(prepared), _compiles(backend, "ckplan's plan of the model"):
        fitted = fit_compiled(prepared, budget_bytes - extra, prepared.example, opts.loss_fn,
                              keep_output=opts.keep_output, compiled_plain_bytes=plain.peak_bytes,
                              progress=opts.progress, backend=backend, per_region=False, loop=prepared.loop)
    if fitted is None or not fitted.fits:
        least = plain.peak_bytes if fitted is None else fitted.probe.peak_bytes
        raise InfeasibleBudget(budget_bytes, least + extra, reason=f"the training step compiled with {backend}, "
                               f"measured for each plan tried")
    graphs = fitted.probe.graphs
    plan = replace(fitted.plan, budget_bytes=budget_bytes, compiled_step=CompiledStep(
        backend=backend, peak_bytes=max(fitted.probe.peak_bytes + extra, optimizer_bytes),
        baseline_peak_bytes=baseline_bytes, graphs=graphs))
    if target is None:
        return plan  # the clone fit_compiled measured, the embedding's graph break on it
    module = prepared.executor.build(prepared.model, prepared.captured, plan.segments, target=target,
                                     planned=plan.planned_shapes()).module
    embedding = input_embedding(module) if graphs is Graphs.INPUTS_APART else None
    if embedding is not None:
        break_graph_after(module, embedding)
    return replace(plan, module=module)


def loop_bytes(prepared: Prepared) -> int:
    """Bytes the loop keeps alive besides a measured step of it (``measure_step_in_loop``), at every moment: the
    optimizer's state and the micro-batches held beside the step's own."""
    loop = prepared.loop
    state = loop.optimizer.state_bytes if loop.optimizer is not None else 0
    return state + (loop.batches_held - 1) * prepared.profile.input_bytes


@contextlib.contextmanager
def _compiles(backend: str, what: str) -> Iterator[None]:
    """Turns a failure to compile (dynamo's, the backend's) into one line naming it and the ways out."""
    try:
        yield
    except PlannerError:
        raise
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise CompileError(f"{what} does not compile with torch.compile's {backend!r} backend ({type(exc).__name__}: "
                           f"{first}): train it eagerly, or plan the eager step with compilable=True instead of "
                           f"compile_backend") from exc


def _as_trained(prepared: Prepared) -> contextlib.AbstractContextManager:
    """The loop's autocast around the measured steps (the step is profiled under it too), or nothing."""
    dtype = prepared.loop.autocast_dtype
    if dtype is None:
        return contextlib.nullcontext()
    device = next(prepared.model.parameters()).device.type
    return torch.autocast(device, dtype=dtype)
