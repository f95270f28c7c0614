"""Every private torch entry point ckplan uses, wrapped: the rest of ``planner/`` imports these names from here.

Each wrapper calls torch with keyword arguments where torch takes them and checks, the first time it is used,
that what it needs exists with the signature it was written for; if not it raises ``TorchVersionError``, one line
naming the installed torch, what is missing and the releases ckplan is tested on. Modules that are slow to
import (dynamo, inductor) are imported when first needed. Tested on torch ``TESTED_TORCH`` (CI runs the oldest
and the newest of them).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
import torch.utils.checkpoint as checkpoint_module
from torch import nn
from torch.fx.experimental import proxy_tensor

from planner.errors import TorchVersionError

TESTED_TORCH = ("2.9.1", "2.13.0", "2.14.1")
"""The torch releases CI runs ckplan's tests on: the oldest is ``pyproject.toml``'s floor."""


def _missing(what: str) -> TorchVersionError:
    return TorchVersionError(
        f"ckplan needs {what}, which torch {torch.__version__} does not have; install a torch release ckplan is "
        f"tested on ({', '.join(TESTED_TORCH)}) or one between them")


def _need(module_name: str, name: str) -> Any:
    """``module_name.name``, or the one-line ``TorchVersionError`` saying it is missing."""
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError):
        raise _missing(f"{module_name}.{name}") from None


def _module(name: str) -> Any:
    """The module ``name``, or the one-line ``TorchVersionError`` saying it is missing."""
    try:
        return importlib.import_module(name)
    except ImportError:
        raise _missing(name) from None


# pytrees: torch's own flattening of nested containers (what dynamo, export and checkpoint use)
tree_flatten = _need("torch.utils._pytree", "tree_flatten")
tree_unflatten = _need("torch.utils._pytree", "tree_unflatten")
tree_leaves = _need("torch.utils._pytree", "tree_leaves")
tree_map = _need("torch.utils._pytree", "tree_map")
tree_map_only = _need("torch.utils._pytree", "tree_map_only")
_tree_flatten_spec = _need("torch.fx._pytree", "tree_flatten_spec")

# dispatch: the documented base class of ``__torch_dispatch__`` modes lives in a private module
TorchDispatchMode = _need("torch.utils._python_dispatch", "TorchDispatchMode")
_disable_current_modes = _need("torch.utils._python_dispatch", "_disable_current_modes")
OpOverload = _need("torch._ops", "OpOverload")
"""The type of an ATen op overload (``torch.ops.aten.mm.default``): a node of an ATen graph targets one."""


def flatten_with_spec(tree: Any, spec: Any) -> list:
    """The leaves of ``tree`` in the order of the pytree ``spec`` (an exported graph's inputs)."""
    return _tree_flatten_spec(tree, spec)


def disable_current_modes() -> contextlib.AbstractContextManager:
    """While open, no dispatch mode (ckplan's trackers, make_fx's proxy mode) sees the ops that run."""
    return _disable_current_modes()


def disable_torch_function() -> contextlib.AbstractContextManager:
    """While open, no ``__torch_function__`` override or mode sees the calls that run."""
    return _need("torch._C", "DisableTorchFunction")()


def parse_to(*args: Any, **kwargs: Any) -> tuple:
    """``Tensor.to``'s arguments after the tensor, parsed as torch does: (device, dtype, non_blocking,
    memory_format), each None where not given."""
    return _need("torch._C._nn", "_parse_to")(*args, **kwargs)


def storage_id(storage: torch.UntypedStorage) -> int:
    """The identity of a storage (its C pointer, shared by every Python object for it; valid while alive)."""
    return storage._cdata


def forward_hooks(module: nn.Module) -> tuple[list, list]:
    """The forward pre-hooks and forward hooks registered on ``module`` (the objects, not their handles)."""
    return list(module._forward_pre_hooks.values()), list(module._forward_hooks.values())


# torch.fx graphs

def set_pytree_calling(gm: fx.GraphModule, arg_names: list[str], in_spec: Any, out_spec: Any) -> None:
    """Makes ``gm`` take the arguments ``arg_names`` (nested as ``in_spec``) and return ``out_spec``'s structure,
    as graphs from ``torch.export`` do; call ``gm.recompile()`` after."""
    codegen, info = _need("torch.fx.graph", "_PyTreeCodeGen"), _need("torch.fx.graph", "_PyTreeInfo")
    gm.graph._codegen = codegen(info(orig_args=arg_names, in_spec=in_spec, out_spec=out_spec))


def pytree_specs(gm: nn.Module) -> tuple[Any, Any] | None:
    """The (input, output) pytree specs of a graph module that takes and returns nested values, else None."""
    in_spec, out_spec = getattr(gm, "_in_spec", None), getattr(gm, "_out_spec", None)
    return (in_spec, out_spec) if in_spec is not None and out_spec is not None else None


def last_node(graph: fx.Graph) -> fx.Node:
    """The graph's last node; the graph's root sentinel (``op == "root"``) when it has none. The node after it
    is the first node added later."""
    return graph._root.prev


# make_fx and its proxy mode

@functools.cache
def _make_fx_keywords() -> None:
    names = inspect.signature(proxy_tensor.make_fx).parameters
    for keyword in ("pre_dispatch", "record_module_stack", "_error_on_data_dependent_ops"):
        if keyword not in names:
            raise _missing(f"torch.fx.experimental.proxy_tensor.make_fx({keyword}=...)")


def make_fx_real(fn: Callable, *, pre_dispatch: bool, record_module_stack: bool) -> Callable[..., fx.GraphModule]:
    """``make_fx`` tracing ``fn`` on real tensors, where reading a tensor's value (``.item()``, ``bool(t)``) is
    recorded rather than refused."""
    _make_fx_keywords()
    return proxy_tensor.make_fx(fn, tracing_mode="real", pre_dispatch=pre_dispatch,
                                record_module_stack=record_module_stack, _error_on_data_dependent_ops=False)


def tracing_graph() -> tuple[Any, fx.Graph] | None:
    """(tracer, graph) of the ``make_fx`` trace in progress, None outside one."""
    mode = _need("torch.fx.experimental.proxy_tensor", "get_proxy_mode")()
    return None if mode is None else (mode.tracer, mode.tracer.graph)


def traced_node(tensor: torch.Tensor, tracer: Any) -> fx.Node | None:
    """The graph node that made ``tensor`` in the trace of ``tracer``, None if the trace has not seen it."""
    slot = _need("torch.fx.experimental.proxy_tensor", "get_proxy_slot")(tensor, tracer, None)
    return None if slot is None else slot.proxy.node


def traced_proxies(tree: Any, tracer: Any) -> Any:
    """``tree`` with each tensor replaced by its proxy in the trace of ``tracer`` (tensors it has not seen
    stay themselves: constants)."""
    get_slot = _need("torch.fx.experimental.proxy_tensor", "get_proxy_slot")
    return tree_map_only(torch.Tensor, lambda t: get_slot(t, tracer, t, lambda s: s.proxy), tree)


def track_outputs(out: Any, proxy: fx.Proxy, tracer: Any) -> None:
    """Records that the tensors of ``out`` are the values of ``proxy`` in the trace of ``tracer``."""
    _need("torch.fx.experimental.proxy_tensor", "track_tensor_tree")(out, proxy, constant=None, tracer=tracer)


# autograd.Function

ApplyFn = Callable[..., Any]


@contextlib.contextmanager
def function_apply_replaced(replacement: Callable[..., Any]) -> Iterator[None]:
    """While open, ``SomeFunction.apply(*args, **kwargs)`` of every custom ``torch.autograd.Function`` calls
    ``replacement(cls, original, *args, **kwargs)``, where ``original(cls, *args, **kwargs)`` is torch's own
    ``apply``. Independent of how torch binds ``apply`` (a classmethod up to 2.13, a C builtin of
    ``torch._C._FunctionBase`` from 2.14): torch's attribute is taken as it is stored and bound to each class."""
    function = torch.autograd.Function
    stored = inspect.getattr_static(function, "apply")
    if not hasattr(stored, "__get__"):
        raise _missing("torch.autograd.Function.apply as a class-bound method")
    own = "apply" in vars(function)

    def original(cls: type, *args: Any, **kwargs: Any) -> Any:
        return stored.__get__(None, cls)(*args, **kwargs)

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        return replacement(cls, original, *args, **kwargs)

    function.apply = classmethod(apply)  # type: ignore[assignment, method-assign]
    try:
        yield
    finally:
        if own:
            function.apply = stored  # type: ignore[method-assign]
        else:
            del function.apply


# torch.utils.checkpoint

_GENERATOR_POSITIONALS = ["fn", "preserve_rng_state", "context_fn", "determinism_check", "debug", "early_stop"]


@functools.cache
def _checkpoint_generator() -> tuple[Callable, bool]:
    """(torch's non-reentrant checkpoint generator, whether it takes keywords)."""
    impl = getattr(checkpoint_module, "_checkpoint_without_reentrant_generator_impl", None)
    if impl is not None:
        names = inspect.signature(impl).parameters
        if all(name in names for name in [*_GENERATOR_POSITIONALS, "args", "kwargs"]):
            return impl, True
    generator = _need("torch.utils.checkpoint", "_checkpoint_without_reentrant_generator")
    if list(inspect.signature(generator).parameters)[:len(_GENERATOR_POSITIONALS)] != _GENERATOR_POSITIONALS:
        raise _missing(f"torch.utils.checkpoint._checkpoint_without_reentrant_generator"
                       f"({', '.join(_GENERATOR_POSITIONALS)}, *args)")
    return generator, False


def checkpoint_region(fn: Callable, *args: Any, preserve_rng_state: bool, context_fn: Callable,
                      early_stop: bool = True) -> Iterator[None]:
    """The generator ``torch.utils.checkpoint`` runs a non-reentrant checkpoint with (what
    ``torch.distributed._composable.checkpoint`` uses): ``next()`` opens the region, ops until the second
    ``next()`` are checkpointed, and ``fn(*args)`` re-runs them in backward."""
    generator, keywords = _checkpoint_generator()
    if keywords:
        return generator(fn, args, {}, preserve_rng_state=preserve_rng_state, context_fn=context_fn,
                         determinism_check="default", debug=False, early_stop=early_stop)
    return generator(fn, preserve_rng_state, context_fn, "default", False, early_stop, *args)


# torch.profiler's memory events: the CPU allocator's every allocation and free

def allocation_profiler_start() -> bool:
    """Starts torch's profiler recording the CPU allocator's allocations and frees and user ranges only (no op
    events: what it holds grows with the allocations, not with the ops); False, starting nothing, when a
    profiler is running already."""
    autograd = torch.autograd
    if autograd._profiler_enabled():
        return False
    profiler = _module("torch._C._profiler")
    config = autograd.ProfilerConfig(autograd.ProfilerState.KINETO, False, True, False, False, False,
                                     profiler._ExperimentalConfig())
    activities = {autograd.ProfilerActivity.CPU}
    with _kineto_quiet():
        autograd._prepare_profiler(config, activities)
        enable = _need("torch.autograd", "_enable_profiler")  # its third argument, the scopes: not in torch's stubs
        enable(config, activities, {profiler.RecordScope.USER_SCOPE})
    return True


def allocation_profiler_stop() -> Any:
    """Stops what ``allocation_profiler_start`` started; its result (for ``profiled_allocations``)."""
    with _kineto_quiet():
        return torch.autograd._disable_profiler()


@contextlib.contextmanager
def _kineto_quiet() -> Iterator[None]:
    """Kineto writes a line to the process's stderr each time a profiler starts or stops (``USDT: ...
    profiler_start``), whatever ``KINETO_LOG_LEVEL`` says; ckplan starts one for every step it measures on a CPU.
    While open, file descriptor 2 goes to /dev/null (only around those calls)."""
    import os
    import sys

    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no stderr to mute
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def profiler_range_enter(name: str) -> Any:
    """Opens a user range named ``name`` in the running profiler, dispatching its op past every Python dispatch
    mode (ckplan's trackers must not see it); returns the handle ``profiler_range_exit`` closes."""
    with torch._C._DisableTorchDispatch():
        return torch.ops.profiler._record_function_enter_new(name, None)


def profiler_range_exit(handle: Any) -> None:
    """Closes a range ``profiler_range_enter`` opened."""
    with torch._C._DisableTorchDispatch():
        torch.ops.profiler._record_function_exit._RecordFunction(handle)


def profiled_allocations(result: Any, device: torch.device, *,
                         region: str) -> list[tuple[int, int, int, int, bool, str]]:
    """What the profiler's ``result`` saw of ``device``'s allocator, in time order: ``(time_ns, order, nbytes, ptr,
    in_region, "")`` for every allocation (``nbytes > 0``) and free (``< 0``) there, ``in_region`` when made inside a
    range named ``region``; and ``(time_ns, order, 0, -1, False, name)`` for every other user range (``order``: the
    event's position, which breaks ties)."""
    event_type = _need("torch._C._profiler", "_EventType")
    allocation, torch_op = event_type.Allocation, event_type.TorchOp
    found: list[tuple[int, int, int, int, bool, str]] = []
    stack = [(event, False) for event in reversed(result.experimental_event_tree())]
    while stack:
        event, inside = stack.pop()
        if event.tag == allocation:
            fields = event.extra_fields
            if fields.device.type == device.type:
                found.append((event.start_time_ns, len(found), int(fields.alloc_size), int(fields.ptr), inside, ""))
        elif event.tag == torch_op and event.name != region:
            found.append((event.start_time_ns, len(found), 0, -1, False, event.name))
        inside_children = inside or (event.tag == torch_op and event.name == region)
        stack.extend((child, inside_children) for child in reversed(event.children))
    found.sort()
    return found


# torch.compile's settings

def activation_memory_budget(fraction: float) -> contextlib.AbstractContextManager:
    """While open, AOTAutograd partitions compiled graphs at ``activation_memory_budget=fraction``."""
    config = _module("torch._functorch.config")
    return config.patch(activation_memory_budget=fraction)


def skip_checkpoint_side_effects_in_backward() -> None:
    """Has dynamo trace a checkpointed region whose forward mutates state outside it (Hugging Face's output
    recorder, hub kernels' layers) into the graph, without replaying that mutation when the region is re-run in
    backward, instead of breaking the graph there (``skip_fwd_side_effects_in_bwd_under_checkpoint``; a
    process-wide setting of torch.compile, left as it is on a torch without it)."""
    config = _module("torch._dynamo.config")
    if hasattr(config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        config.skip_fwd_side_effects_in_bwd_under_checkpoint = True


def checkpoint_side_effects_break_graph() -> contextlib.AbstractContextManager:
    """While open, dynamo breaks the graph at a checkpointed region whose forward mutates state outside it, as
    torch.compile does by default (``skip_checkpoint_side_effects_in_backward`` undone)."""
    config = _module("torch._dynamo.config")
    if hasattr(config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        return config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=False)
    return contextlib.nullcontext()


def compile_fx(gm: fx.GraphModule, example_inputs: list) -> Any:
    """Inductor's compiler (``torch.compile``'s default backend) on one dynamo graph."""
    return _need("torch._inductor.compile_fx", "compile_fx")(gm, example_inputs)


def graph_breaker() -> Callable[[], None]:
    """``torch._dynamo.graph_break``: called where dynamo traces, it ends the graph there; in eager code it does
    nothing. Resolved here, outside traced code."""
    return _need("torch._dynamo", "graph_break")


def compile_backend_of(context: Any) -> str | None:
    """The name of the backend a ``torch.compile`` result (an ``OptimizedModule``'s ``dynamo_ctx``, or what a
    framework kept of it) compiles with (``inductor``, ``aot_eager``), found through dynamo's wrappers of its
    callback; None where it is not told."""
    found = getattr(context, "callback", context)
    for _ in range(8):  # dynamo wraps the backend a few layers deep
        name = getattr(found, "compiler_name", None)
        if isinstance(name, str) and name:
            return name
        inner = getattr(found, "_torchdynamo_orig_backend", None) or getattr(found, "_torchdynamo_orig_callable", None)
        if inner is None or inner is found:
            return None
        found = inner
    return None


def recompile_limits_raised(by: int) -> contextlib.AbstractContextManager:
    """While open, dynamo's per-frame recompile limits are ``by`` entries higher."""
    config = _module("torch._dynamo.config")
    return config.patch(recompile_limit=config.recompile_limit + by,
                        accumulated_recompile_limit=config.accumulated_recompile_limit + by)
