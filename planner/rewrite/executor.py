"""How a plan runs: the two executors, and the one place that chooses between them.

A plan runs either as a rewritten graph (``GraphExecutor``: torch.fx traced the model; each segment is a
generated method called through ``torch.utils.checkpoint``, ``planner.rewrite.graph``) or through the
user's own modules (``HookExecutor``: models fx cannot trace, Hugging Face ones; each segment is a chain
of module calls entered and left by forward hooks, ``planner.rewrite.chains``). The stages must agree on
what the chosen one allows: which runs of nodes may be segments, which nodes a segment can keep, whether
a segment runs the modules' own code. Each executor answers that once, as ``SegmentRules`` the memory
model and the solvers read, and builds the planned module from the plan's segments.
``executor_for`` is the only code that looks at how a model was captured to decide how its plan runs.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import nn

from planner.capture.api import Captured, capture
from planner.capture.calls import member_call
from planner.capture.fsdp_units import resolve_units
from planner.capture.inputs import as_inputs
from planner.capture.method import CaptureMethod, ExecutorKind
from planner.capture.tree import clone_tree
from planner.errors import PlanMismatch
from planner.memory.chains import find_chains, one_unit
from planner.memory.regions import checkpointable_end
from planner.memory.rules import SegmentRules
from planner.profiling.record import Profile
from planner.rewrite.chains import Chain
from planner.rewrite.graph import SegmentSpec, rewrite
from planner.rewrite.modules import PlannedShapes, describe, install_plan, install_switching
from planner.rewrite.sac import is_single_op
from planner.rewrite.segment import Segment
from planner.rewrite.switching import Chooser


@dataclass(frozen=True, kw_only=True, slots=True)
class Built:
    """A planned module and what ``--emit`` shows of it."""

    module: nn.Module
    source: str
    """Python source of the generated class, or the chains as comments (plans run by hooks)."""


class Executor(abc.ABC):
    """One way of running a plan: the rules every stage follows, and building the planned module."""

    kind: ClassVar[ExecutorKind]

    def __init__(self, method: CaptureMethod) -> None:
        self.method = method
        """How the model was captured (what ``apply`` captures a fresh instance with again)."""

    @abc.abstractmethod
    def rules(self, captured: Captured, profile: Profile, *, units: Sequence[str] = (),
              compilable: bool = False) -> SegmentRules:
        """Where segments may lie, which nodes they can keep, which module code they run; ``units``: the
        FSDP units of a distributed plan (a segment re-runs at most one); ``compilable``: only segments
        ``torch.compile`` can run."""

    @abc.abstractmethod
    def build(self, model: nn.Module, captured: Captured, segments: Sequence[Segment], *,
              target: nn.Module | None = None, planned: PlannedShapes | None = None,
              follow: Chooser | None = None) -> Built:
        """The module that runs ``segments`` of the captured ``model`` (not modified unless it is ``target``).

        Args:
            target: the module tree to plan in place (``enable``); only plans run by hooks support it.
            planned: the shapes and peak the plan was made for (a plan run by hooks warns on larger calls).
            follow: a plan that changes with each training call (``planner.follow``): ``segments`` are its
                example group's; only plans run by hooks support it.
        """

    @abc.abstractmethod
    def apply(self, model: nn.Module, segments: Sequence[Segment], *, fingerprint: str, inputs: Any = None,
              units: Sequence[str] | None = None, planned: PlannedShapes | None = None,
              follow: Chooser | None = None) -> nn.Module:
        """A saved plan's module on ``model``, a fresh instance of the architecture it was made for
        (``follow`` as for ``build``).

        Raises:
            PlanMismatch: ``model`` does not capture to the graph the plan was made for (``fingerprint``).
        """


class GraphExecutor(Executor):
    """Plans of models torch.fx traces: the rewritten graph (``planner.rewrite.graph``)."""

    kind = ExecutorKind.GRAPH

    def rules(self, captured: Captured, profile: Profile, *, units: Sequence[str] = (),
              compilable: bool = False) -> SegmentRules:
        """Any run of nodes; single ops can be kept; segments run the traced code of what they cut. FSDP
        units captured as calls fix the chunking (segments are cut between them: ``split_at_units``). Every
        such plan compiles."""
        return SegmentRules(spans=None, savable=_single_ops(captured, profile), opens_modules=True,
                            refinable=self.method is not CaptureMethod.FX_UNITS)

    def build(self, model: nn.Module, captured: Captured, segments: Sequence[Segment], *,
              target: nn.Module | None = None, planned: PlannedShapes | None = None,
              follow: Chooser | None = None) -> Built:
        if target is not None or follow is not None:
            raise ValueError("a rewritten graph is one new module for one shape: plan the model's own object "
                             "(enable) or a plan that follows the batch with the hook executor")
        rewritten = rewrite(model, captured, [_spec(s) for s in segments])
        return Built(module=rewritten.module, source=rewritten.source)

    def apply(self, model: nn.Module, segments: Sequence[Segment], *, fingerprint: str, inputs: Any = None,
              units: Sequence[str] | None = None, planned: PlannedShapes | None = None,
              follow: Chooser | None = None) -> nn.Module:
        if follow is not None:
            raise ValueError("a plan that follows the batch runs by hooks, not as a rewritten graph")
        if self.method is CaptureMethod.FX_UNITS:  # captured with its FSDP units kept as calls
            captured = capture(model, units=frozenset(resolve_units(model, units)))
        else:
            example = as_inputs(model, inputs) if inputs is not None or hasattr(model, "example_inputs") else None
            captured = capture(model, example)
        if captured.fingerprint != fingerprint:
            fix = ("pass the units= the plan was made with, on the same architecture"
                   if self.method is CaptureMethod.FX_UNITS else
                   "apply it to the same architecture and configuration, or plan again")
            raise PlanMismatch(f"this plan was made for a graph with fingerprint {fingerprint}, but "
                               f"{type(model).__name__} traces to {captured.fingerprint}: {fix}")
        return rewrite(model, captured, [_spec(s) for s in segments]).module


class HookExecutor(Executor):
    """Plans that run the model's own forward: chains of module calls entered and left by forward hooks
    (``planner.rewrite.chains``), on a clone of the module tree or on the model itself (``enable``)."""

    kind = ExecutorKind.HOOKS

    def rules(self, captured: Captured, profile: Profile, *, units: Sequence[str] = (),
              compilable: bool = False) -> SegmentRules:
        """Chains of module calls only (under FSDP, chains that re-run at most one unit, ``one_unit``; with
        ``compilable``, chains of one call of a module, at each of its calls); any single op whose kernels the
        profile names can be kept (``Segment.saved_ops``: selective checkpointing finds them by their order among
        the chain's ops); every module runs its own code."""
        end = checkpointable_end(profile)
        savable = frozenset(i for i in _single_ops(captured, profile) if profile.nodes[i].kernels)
        spans = tuple(s for s in find_chains(profile.calls, end) if one_unit(s, units)
                      and (not compilable or (len(s.members) == 1 and member_call(s.members[0])[1] is None)))
        return SegmentRules(spans=spans, savable=savable, opens_modules=False)

    def build(self, model: nn.Module, captured: Captured, segments: Sequence[Segment], *,
              target: nn.Module | None = None, planned: PlannedShapes | None = None,
              follow: Chooser | None = None) -> Built:
        module = clone_tree(model)[0] if target is None else target
        self._install(module, segments, planned=planned, follow=follow)
        return Built(module=module, source=describe([Chain.of(s) for s in segments], model))

    def apply(self, model: nn.Module, segments: Sequence[Segment], *, fingerprint: str, inputs: Any = None,
              units: Sequence[str] | None = None, planned: PlannedShapes | None = None,
              follow: Chooser | None = None) -> nn.Module:
        """Needs no inputs and no capture: each chain checks on its first training forward that the model
        runs it (``ChainError`` names a module the model does not have)."""
        module = clone_tree(model)[0]
        self._install(module, segments, planned=planned, follow=follow)
        return module

    @staticmethod
    def _install(module: nn.Module, segments: Sequence[Segment], *, planned: PlannedShapes | None,
                 follow: Chooser | None) -> None:
        """The only place a hook plan goes on a module: one plan's chains, or the switch between the plans of
        a plan that follows the batch (``segments`` its example group's), replacing any plan there before."""
        if follow is None:
            install_plan(module, [Chain.of(s) for s in segments], planned=planned)
        else:
            install_switching(module, follow, (follow.example_group, segments))


def executor_for(method: CaptureMethod) -> Executor:
    """The executor of plans for a model captured by ``method`` (``CaptureMethod.executor`` says which)."""
    return HookExecutor(method) if method.executor is ExecutorKind.HOOKS else GraphExecutor(method)


def _single_ops(captured: Captured, profile: Profile) -> frozenset[int]:
    """Nodes that run one fresh-output, non-random op and write no buffer: what a segment can keep exactly."""
    graph = {n.name: n for n in captured.graph_module.graph.nodes}
    return frozenset(i for i, node in enumerate(profile.nodes)
                     if node.name in graph and is_single_op(graph[node.name], captured.graph_module))


def _spec(segment: Segment) -> SegmentSpec:
    return SegmentSpec(nodes=segment.nodes, restore_buffers=segment.restore_buffers, saved_nodes=segment.saved_nodes,
                       random=segment.random)
