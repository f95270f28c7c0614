"""Which runs of the graph a plan run by module hooks can checkpoint: chains of consecutive module calls.

A model captured as ATen ops (``torch.export`` or ``make_fx``) is planned on its ATen graph but runs
its own Python code, with checkpoints entered and left by forward hooks (``planner.rewrite.chains``).
A segment must then be a *chain*: one or more consecutive calls of sibling modules, with no node of their caller
between them (code there would not be re-run). A module called more than once per forward (a cell unrolled in a
loop, a shared block applied N times) is a member by its call index (``cell#7``: its eighth call), so each of its
calls, or a run of them, can be checkpointed on its own. The hook
executor (``planner.rewrite.executor``) asks for these; torch-free, on the profile's call index.
"""

from __future__ import annotations

from collections.abc import Sequence

from planner.capture.calls import CallIndex, ModuleCall, member, member_call
from planner.memory.rules import Span


def find_chains(calls: CallIndex, end: int) -> list[Span]:
    """Every chain within nodes ``[0, end)``, outermost first where two cover the same nodes."""
    by_parent: dict[int | None, list[ModuleCall]] = {}
    for call in _chainable(calls, end):
        by_parent.setdefault(call.parent, []).append(call)
    found: dict[tuple[int, int], Span] = {}
    for siblings in sorted(by_parent.values(), key=lambda cs: min(len(c.entry) for c in cs)):
        siblings.sort(key=lambda c: c.first)
        for i, first in enumerate(siblings):
            members: list[ModuleCall] = []
            for call in siblings[i:]:
                if members and (call.first != members[-1].last + 1 or _parent(call) != _parent(first)):
                    break
                members.append(call)
                found.setdefault((first.first, call.last + 1), Span(lo=first.first, hi=call.last + 1,
                                                                    members=tuple(_named(calls, c) for c in members)))
    return sorted(found.values(), key=lambda c: (c.lo, -c.hi))


def one_unit(span: Span, units: Sequence[str]) -> bool:
    """Whether a plan run by hooks may checkpoint ``span`` under FSDP2 with these ``units``: its re-run
    touches at most one unit, and a member that is (or holds) a unit is the chain's last, so no unit is
    re-run before its own backward (which would gather it early and hold it gathered until then)."""
    touched: set[str] = set()
    for i, name in enumerate(span.members):
        path = member_call(name)[0]
        holds = {u for u in units if u == path or u.startswith(path + ".")}
        inside = {u for u in units if path.startswith(u + ".")}
        if holds and i < len(span.members) - 1:
            return False
        touched |= holds | inside
    return len(touched) <= 1


def _named(calls: CallIndex, call: ModuleCall) -> str:
    """The chain member ``call`` is: its module's path, with its call index when the module is called more than
    once per forward (``capture.calls.member``)."""
    return member(call.path, call.index if calls.times_called(call.path) > 1 else None)


def _parent(call: ModuleCall) -> str:
    """Path of the module that owns ``call``'s module as a child (its siblings share it)."""
    return call.path.rpartition(".")[0]


def _chainable(calls: CallIndex, end: int) -> list[ModuleCall]:
    """Module calls that can be chain members: contiguous runs of nodes before ``end``, entered from one place."""
    return [call for call in calls.calls
            if call.path and call.contiguous and call.last < end and call.single_parent]
