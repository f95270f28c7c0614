"""Which runs of the graph the module executor can checkpoint: chains of consecutive module calls.

A model captured with ``torch.export`` is planned on its ATen graph but runs its own Python code,
with checkpoints entered and left by forward hooks (``planner.rewrite.chains``). A segment must then
be a *chain*: one or more consecutive calls of sibling modules, each called once per forward, with
no node of their caller between them (code there would not be re-run). Torch-free: it reads the
module scopes the profile recorded per node.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.capture.scope import path_of
from planner.profiling.record import Profile


@dataclass(frozen=True, kw_only=True, slots=True)
class Chain:
    """A run of nodes the module executor can checkpoint."""

    lo: int
    """First node."""
    hi: int
    """One past the last node."""
    members: tuple[str, ...]
    """Module paths of the calls, in order (siblings)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class _Call:
    entry: str
    lo: int
    hi: int
    parent: str | None
    """Scope entry of the enclosing call (None: the root's own forward)."""


def find_chains(profile: Profile, end: int) -> list[Chain]:
    """Every chain within nodes ``[0, end)``, outermost first where two cover the same nodes."""
    calls = _calls(profile, end)
    by_parent: dict[str | None, list[_Call]] = {}
    for call in calls:
        by_parent.setdefault(call.parent, []).append(call)
    found: dict[tuple[int, int], Chain] = {}
    for siblings in sorted(by_parent.values(), key=lambda cs: min(len(c.entry) for c in cs)):
        siblings.sort(key=lambda c: c.lo)
        for i, first in enumerate(siblings):
            members = []
            for call in siblings[i:]:
                if members and (call.lo != members[-1].hi or _parent(call) != _parent(first)):
                    break
                members.append(call)
                key = (first.lo, call.hi)
                found.setdefault(key, Chain(lo=first.lo, hi=call.hi, members=tuple(path_of(c.entry) for c in members)))
    return sorted(found.values(), key=lambda c: (c.lo, -c.hi))


def _parent(call: _Call) -> str:
    return path_of(call.entry).rpartition(".")[0]


def _calls(profile: Profile, end: int) -> list[_Call]:
    """Module calls that are contiguous runs of nodes before ``end``, of modules called once."""
    nodes: dict[str, list[int]] = {}
    parent: dict[str, set] = {}
    for i, node in enumerate(profile.nodes):
        for depth, entry in enumerate(node.scope):
            nodes.setdefault(entry, []).append(i)
            parent.setdefault(entry, set()).add(node.scope[depth - 1] if depth else None)
    per_path: dict[str, int] = {}
    for entry in nodes:
        per_path[path_of(entry)] = per_path.get(path_of(entry), 0) + 1
    out = []
    for entry, members in nodes.items():
        lo, hi = members[0], members[-1] + 1
        if (path_of(entry) and per_path[path_of(entry)] == 1 and len(members) == hi - lo and hi <= end
                and len(parent[entry]) == 1):
            out.append(_Call(entry=entry, lo=lo, hi=hi, parent=next(iter(parent[entry]))))
    return out


def alone_in_module(profile: Profile, end: int) -> frozenset[int]:
    """Nodes that are the only node writing new memory in their module's call (a Linear, an
    activation): the saves the module executor can make, by marking the module's ops."""
    calls = {call.entry: call for call in _calls(profile, end)}
    out = set()
    for i, node in enumerate(profile.nodes[:end]):
        call = calls.get(node.scope[-1]) if node.scope else None
        if call is not None and node.outputs and not any(
                profile.nodes[j].outputs for j in range(call.lo, call.hi) if j != i):
            out.add(i)
    return frozenset(out)
