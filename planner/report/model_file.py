"""The model file ``ckplan`` runs: executed once as its own module, its names resolved.

It defines module-level ``model`` (an nn.Module or a zero-argument callable returning one),
``inputs`` (tuple or dict of tensors, or a callable returning one) and optionally
``loss_fn(output) -> scalar`` (docs/cli.md, "The model file"). Every mistake in it is a
``UserError``: one line naming the file and line, exit code 2.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from planner.capture.inputs import as_inputs
from planner.compat.torch_private import tree_map
from planner.errors import InputError, PlannerError

MODEL_MODULE = "__ckplan_model__"
"""Name the model file runs under, so its ``if __name__ == "__main__":`` block does not run."""

_LIBRARY_DIRS = tuple(
    os.path.abspath(p) + os.sep
    for p in (os.path.dirname(os.path.dirname(__file__)), os.path.dirname(torch.__file__),
              sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"])
)


class UserError(PlannerError):
    """A mistake in the command line or the model file: one message, exit code 2 (a ``PlannerError``, as
    every user mistake is)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelFile:
    """What the model file defines, resolved (callables called)."""

    path: str
    model: nn.Module
    inputs: Any
    """Positional (tuple) or keyword (dict) arguments of ``model``."""
    loss_fn: Callable[[Any], torch.Tensor] | None
    namespace: dict[str, Any]
    """The file's globals (functions defined there read their tensors from it)."""

def load_model_file(path: str, *, model: str = "model", inputs: str = "inputs",
                    loss: str | None = None) -> ModelFile:
    """Runs the model file and returns what it defines under the given names.

    Raises:
        UserError: the file is missing or fails, or lacks a name, or a value has the wrong type.
    """
    namespace = _run_file(path)
    found_model = _resolve(namespace, path, model, "--model")
    if not isinstance(found_model, nn.Module):
        raise UserError(f"`{model}` in {path} is of type {type(found_model).__name__}, not a torch.nn.Module "
                        "(nor a zero-argument callable returning one)")
    if inputs in namespace or inputs != "inputs" or getattr(found_model, "example_inputs", None) is None:
        found_inputs = _resolve(namespace, path, inputs, "--inputs")
    else:  # the model's own `example_inputs`, as optimize() would use
        inputs = "example_inputs"
        found_inputs = _resolve({inputs: found_model.example_inputs}, path, inputs, "--inputs")
    try:
        as_inputs(found_model, found_inputs)
    except InputError as exc:
        raise UserError(f"`{inputs}` in {path}: {exc}") from exc
    loss_fn = namespace.get(loss or "loss_fn")
    if loss is not None and loss not in namespace:
        raise UserError(f"{path} defines no `{loss}` (named by --loss)")
    if loss_fn is not None and not callable(loss_fn):
        raise UserError(f"`{loss or 'loss_fn'}` in {path} is of type {type(loss_fn).__name__}, not a function")
    return ModelFile(path=path, model=found_model, inputs=found_inputs, loss_fn=loss_fn, namespace=namespace)


def _run_file(path: str) -> dict[str, Any]:
    """Executes the file as module ``__ckplan_model__`` (its directory importable) and returns its globals."""
    file = Path(path)
    if not file.is_file():
        raise UserError(f"model file {path} does not exist" if not file.exists() else f"{path} is not a file")
    module = types.ModuleType(MODEL_MODULE)
    module.__file__ = str(file)
    sys.modules[MODEL_MODULE] = module  # classes defined in the file find their module (inspect, fx)
    sys.path.insert(0, str(file.resolve().parent))
    argv, sys.argv = sys.argv, [path]  # as `python model.py` would see it (a module-level argparse)
    try:
        exec(compile(file.read_bytes(), path, "exec"), module.__dict__)
    except SyntaxError as exc:
        if exc.filename is None:  # null bytes: not Python source at all (a pickle, a checkpoint)
            raise UserError(f"{path}: {type(exc).__name__}: {exc.msg}; give the Python file that defines "
                            "the model") from exc
        raise UserError(f"{exc.filename}:{exc.lineno}: {type(exc).__name__}: {exc.msg}") from exc
    except SystemExit as exc:
        raise UserError(f"{located(exc, fallback=path)}: the model file exited while loading; keep training "
                        "code under `if __name__ == \"__main__\":`") from exc
    except Exception as exc:
        raise UserError(located(exc, fallback=path)) from exc
    finally:
        sys.argv = argv
    return module.__dict__


def _resolve(namespace: dict[str, Any], path: str, name: str, flag: str) -> Any:
    """``namespace[name]``, called when it is a zero-argument callable (not a module or tensor)."""
    if name not in namespace:
        default = flag.removeprefix("--")
        hint = f"define a module-level `{default}`, or name another with {flag} NAME" if name == default \
            else f"check the name given to {flag}"
        raise UserError(f"{path} defines no `{name}`: {hint}")
    value = namespace[name]
    if callable(value) and not isinstance(value, (nn.Module, torch.Tensor)):
        try:
            value = value()
        except Exception as exc:
            raise UserError(located(exc, fallback=f"calling `{name}` from {path}")) from exc
    return value


def located(exc: BaseException, *, fallback: str) -> str:
    """``file:line: Type: message`` at the innermost frame of the user's own code."""
    where = fallback
    for frame in traceback.extract_tb(exc.__traceback__):
        if not os.path.abspath(frame.filename).startswith(_LIBRARY_DIRS) and not frame.filename.startswith("<"):
            where = f"{frame.filename}:{frame.lineno}"
    return f"{where}: {type(exc).__name__}: {exc}"


def to_device(found: ModelFile, device: torch.device) -> ModelFile:
    """Moves the model, the inputs and the file's module-level tensors (a loss_fn's labels) to ``device``."""
    def move(value: Any) -> Any:
        return value.to(device) if isinstance(value, torch.Tensor) else value

    for name, value in list(found.namespace.items()):
        if isinstance(value, torch.Tensor):
            found.namespace[name] = move(value)
    return ModelFile(path=found.path, model=found.model.to(device), inputs=tree_map(move, found.inputs),
                     loss_fn=found.loss_fn, namespace=found.namespace)
