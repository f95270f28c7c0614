"""torch's private API is reached only through ``planner.compat.torch_private``, which works however torch binds
what it wraps and says in one line what a torch release lacks."""

from __future__ import annotations

import ast
import inspect
import pathlib
import re

import pytest
import torch

import planner
from planner.compat import torch_private
from planner.errors import TorchVersionError

PACKAGE = pathlib.Path(planner.__file__).parent
COMPAT = PACKAGE / "compat" / "torch_private.py"
PRIVATE_ATTRIBUTES = {"_cdata", "_forward_pre_hooks", "_forward_hooks", "_codegen", "_root", "_in_spec", "_out_spec"}
"""Private attributes of torch objects the package reads (through the compat module only)."""


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _dotted(node: ast.AST) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return None


def private_uses(path: pathlib.Path, root: pathlib.Path = PACKAGE.parent) -> list[str]:
    """``file:line: what`` for each private torch name the file imports or reaches through ``torch.``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        where = f"{path.relative_to(root)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            found += [f"{where}: import {a.name}" for a in node.names
                      if a.name.split(".")[0] == "torch" and any(map(_private, a.name.split(".")))]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            module = node.module or ""
            if any(map(_private, module.split("."))) or any(_private(a.name) for a in node.names):
                found.append(f"{where}: from {module} import {', '.join(a.name for a in node.names)}")
            if module == "torch.fx.experimental.proxy_tensor" or any(a.name == "proxy_tensor" for a in node.names):
                found.append(f"{where}: make_fx's proxy internals ({module})")
        elif isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            if dotted and dotted[0] == "torch" and dotted[1:2] != ["ops"] and any(map(_private, dotted[1:])):
                found.append(f"{where}: {'.'.join(dotted)}")
            elif node.attr in PRIVATE_ATTRIBUTES:
                found.append(f"{where}: .{node.attr}")
        elif isinstance(node, ast.Constant) and node.value in PRIVATE_ATTRIBUTES:
            found.append(f"{where}: {node.value!r}")
    return found


def test_no_private_torch_name_outside_the_compat_module():
    uses = [use for path in sorted(PACKAGE.rglob("*.py")) if path != COMPAT for use in private_uses(path)]
    assert uses == []


def test_the_scan_finds_each_kind_of_private_use(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import torch\nimport torch._dynamo.config\nfrom torch.utils._pytree import tree_leaves\n"
                     "from torch.utils.checkpoint import _checkpoint_without_reentrant_generator\n"
                     "from torch.fx.experimental import proxy_tensor\nx = torch._C._nn\nk = s._cdata\n"
                     "spec = getattr(gm, '_in_spec', None)\nok = (torch.ops.aten._to_copy, torch.__version__)\n")
    found = sorted(use.split(": ", 1)[1] for use in private_uses(probe, root=tmp_path))
    assert found == sorted(["import torch._dynamo.config", "from torch.utils._pytree import tree_leaves",
                            "from torch.utils.checkpoint import _checkpoint_without_reentrant_generator",
                            "make_fx's proxy internals (torch.fx.experimental)", "torch._C._nn", "torch._C",
                            "._cdata", "'_in_spec'"])


class _Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return 2 * x

    @staticmethod
    def backward(ctx, grad):
        return 2 * grad


@pytest.mark.parametrize("bound_as", ["torch's own", "a Python classmethod"])
def test_function_apply_is_replaced_and_put_back_however_torch_binds_it(bound_as):
    """torch 2.13 binds ``Function.apply`` as a classmethod, 2.14 as a C builtin of ``_FunctionBase``: the
    replacement sees every call and puts back exactly what was there, either way."""
    function = torch.autograd.Function
    stored, own = inspect.getattr_static(function, "apply"), "apply" in vars(function)
    if bound_as == "a Python classmethod":
        function.apply = classmethod(lambda cls, *args: stored.__get__(None, cls)(*args))  # type: ignore[assignment]
    before = inspect.getattr_static(function, "apply")
    calls = []

    def replacement(cls, original, *args):
        calls.append(cls)
        return original(cls, *args) + 1

    try:
        x = torch.ones(3, requires_grad=True)
        with torch_private.function_apply_replaced(replacement):
            y = _Double.apply(x)
        assert calls == [_Double] and torch.equal(y, torch.full((3,), 3.0))
        y.sum().backward()
        assert torch.equal(x.grad, torch.full((3,), 2.0))
        assert inspect.getattr_static(function, "apply") is before
        assert torch.equal(_Double.apply(torch.ones(2)), torch.full((2,), 2.0))
    finally:
        if own:
            function.apply = stored  # type: ignore[method-assign]
        elif "apply" in vars(function):
            del function.apply


def test_a_checkpoint_generator_of_another_signature_is_one_line_naming_the_torch_version(monkeypatch):
    import torch.utils.checkpoint as checkpoint_module

    def generator(fn, context_fn, preserve_rng_state=True, *args):  # the arguments in an order not written for
        yield

    monkeypatch.delattr(checkpoint_module, "_checkpoint_without_reentrant_generator_impl", raising=False)
    monkeypatch.setattr(checkpoint_module, "_checkpoint_without_reentrant_generator", generator)
    torch_private._checkpoint_generator.cache_clear()
    try:
        with pytest.raises(TorchVersionError, match=rf"torch {re.escape(torch.__version__)} does not have") as error:
            torch_private.checkpoint_region(lambda: None, preserve_rng_state=True, context_fn=lambda: None)
        assert "\n" not in str(error.value) and "_checkpoint_without_reentrant_generator" in str(error.value)
    finally:
        torch_private._checkpoint_generator.cache_clear()


def test_a_missing_private_name_is_one_line_naming_it():
    with pytest.raises(TorchVersionError, match=r"ckplan needs torch\.utils\.checkpoint\._gone, which torch "):
        torch_private._need("torch.utils.checkpoint", "_gone")
