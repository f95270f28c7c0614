"""Capture with ``torch.export`` (non-strict), for models ``torch.fx.symbolic_trace`` cannot trace.

Hugging Face models (transformers 5 dropped its fx tracer) and models with Python
control flow on shapes export fine on example inputs. The graph is ATen-level, taken
from ``ExportedProgram.module()`` (parameters shared with the model, the forward
flattening inputs and unflattening outputs with pytree), with each node's module path
read from its ``nn_module_stack``. It is specialised to the example inputs' shapes.
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Iterator

import torch
import torch.fx as fx
from torch import nn

from planner.capture.calls import SCOPE_KEY, entry


@contextlib.contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    """Silences torch while exporting: a failed export prints the partial graph and warns; ckplan
    reports the failure itself, in one line. Only torch's loggers and Python's ``sys.stdout`` /
    ``sys.stderr`` are redirected, never the process's file descriptors (other threads, the user's
    own logging and C++ output are left alone)."""
    loggers = [logging.getLogger(name) for name in list(logging.Logger.manager.loggerDict) if name.startswith("torch")]
    levels = [(lg, lg.level) for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for lg, level in levels:
            lg.setLevel(level)


def export_graph(model: nn.Module, args: tuple, kwargs: dict) -> fx.GraphModule:
    """The model's training-mode forward as a flat ATen graph with module scopes.

    Raises whatever ``torch.export.export`` raises; the caller reports it.
    """
    flags = [(m, m.training) for m in model.modules()]
    model.train()
    try:
        with _quiet_torch_logs():  # a failed export dumps the partial graph to stderr; we report it in one line
            program = torch.export.export(model, args, kwargs, strict=False)
    finally:
        for m, flag in flags:
            m.training = flag
    gm = program.module()
    for name, param in model.named_parameters():  # share, never copy, the user's parameters
        owner, _, leaf = name.rpartition(".")
        target = gm.get_submodule(owner) if owner else gm
        if getattr(target, leaf, None) is not param and leaf in target._parameters:
            target._parameters[leaf] = param
    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack") or {}
        node.meta[SCOPE_KEY] = tuple(entry(path, key) for key, (path, _) in stack.items() if path)
    return gm
