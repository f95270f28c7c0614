"""The module calls of a captured graph: one index, built once from the nodes' scopes (torch-free).

Capture records, per node, the stack of module calls around it as ``"path#call_index"`` entries,
outermost first (``node.meta[SCOPE_KEY]``, copied into the profile as ``NodeCost.scope``). Every
later stage asks the ``CallIndex`` built from them (``Captured.calls``, ``Profile.calls``): which
call each node runs in, each call's path, first and last node and parent. This module is the only
place that reads the ``"#"`` in an entry.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

SCOPE_KEY = "ckplan_scope"
"""``node.meta`` key: tuple of ``"path#call_index"`` strings, outermost first."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModuleCall:
    """One call of a module during the captured forward."""

    entry: str
    """The scope entry naming it (``"blocks.0.attn#1"``), as capture wrote it."""
    path: str
    """Module path (``"blocks.0.attn"``)."""
    index: int
    """Which call of that module it is, counting from 0."""
    first: int
    """First node inside it."""
    last: int
    """Last node inside it (inclusive)."""
    parent: int | None
    """Index (in ``CallIndex.calls``) of the call it runs in; None when the root's own forward calls it."""
    contiguous: bool
    """Every node from ``first`` to ``last`` runs inside it (no node of another call in between)."""
    single_parent: bool
    """Every node inside it has the same enclosing call (the call is entered from one place)."""


class CallIndex:
    """The module calls of one graph, and which calls enclose each node.

    Built once per graph from the nodes' scopes (``from_scopes``); read by every stage.
    """

    def __init__(self, calls: tuple[ModuleCall, ...], around: tuple[tuple[int, ...], ...]) -> None:
        self.calls = calls
        """Every call, in the order its first node runs."""
        self.around = around
        """Per node: indices of the calls enclosing it, outermost first."""
        self._path_calls: dict[str, int] = {}
        for call in calls:
            self._path_calls[call.path] = self._path_calls.get(call.path, 0) + 1

    @classmethod
    def from_scopes(cls, scopes: Sequence[Sequence[str]]) -> CallIndex:
        """The index of nodes whose scopes (``"path#call_index"`` entries, outermost first) are ``scopes``."""
        ids: dict[str, int] = {}
        first: list[int] = []
        last: list[int] = []
        count: list[int] = []
        parents: list[set[str | None]] = []
        for i, scope in enumerate(scopes):
            for depth, entry in enumerate(scope):
                c = ids.setdefault(entry, len(ids))
                if c == len(first):
                    first.append(i)
                    last.append(i)
                    count.append(0)
                    parents.append(set())
                last[c] = i
                count[c] += 1
                parents[c].add(scope[depth - 1] if depth else None)
        calls = []
        for entry, c in ids.items():
            path, index = _split(entry)
            outer = next(iter(parents[c])) if len(parents[c]) == 1 else None
            calls.append(ModuleCall(entry=entry, path=path, index=index,
                                    first=first[c], last=last[c], parent=None if outer is None else ids[outer],
                                    contiguous=count[c] == last[c] - first[c] + 1,
                                    single_parent=len(parents[c]) == 1))
        around = tuple(tuple(ids[e] for e in scope) for scope in scopes)
        return cls(tuple(calls), around)

    def __len__(self) -> int:
        return len(self.calls)

    def path(self, call: int) -> str:
        """Module path of call ``call``."""
        return self.calls[call].path

    def paths_around(self, node: int) -> tuple[str, ...]:
        """Module paths of the calls enclosing ``node``, outermost first."""
        return tuple(self.calls[c].path for c in self.around[node])

    def module_path(self, node: int) -> str:
        """Path of the innermost module call around ``node`` (``""`` for the root's own code)."""
        around = self.around[node]
        return self.calls[around[-1]].path if around else ""

    def times_called(self, path: str) -> int:
        """How many calls of the module at ``path`` the graph holds."""
        return self._path_calls.get(path, 0)

    def nodes_by_path(self, end: int | None = None) -> dict[str, list[int]]:
        """Per module path (in order of first call), the nodes before ``end`` inside any of its calls."""
        out: dict[str, list[int]] = {}
        for i, around in enumerate(self.around[:end]):
            for c in around:
                out.setdefault(self.calls[c].path, []).append(i)
        return out

    def common_depth(self, a: int, b: int) -> int:
        """How many enclosing calls nodes ``a`` and ``b`` share, from the outermost."""
        depth = 0
        for x, y in zip(self.around[a], self.around[b]):
            if x != y:
                break
            depth += 1
        return depth


def repeated_blocks(paths: Iterable[str]) -> tuple[str, ...]:
    """The model's repeated blocks among module ``paths``: the numbered children ``<container>.<i>``
    (``blocks.0``, ``layers.3``, ``transformer.h.11``) of the container with the most of them, in the
    order of ``paths``; ``()`` when no path ends in a number.

    Ties go to the container whose children hold the most modules among ``paths`` (themselves and
    everything inside), then to the first one seen. Capture and FSDP's default units pass the module
    tree (``named_modules``, before any graph exists), the regions pass the modules the graph calls;
    on the same model both give the same blocks (ResNet's four stages of two blocks each: the first
    stage with a downsample branch, ``layer2``).

    >>> repeated_blocks(["stem", "layers.0", "layers.0.fc", "layers.1", "layers.1.fc", "head"])
    ('layers.0', 'layers.1')
    """
    order = list(dict.fromkeys(paths))
    children: dict[str, list[str]] = {}
    for path in order:
        parent, _, last = path.rpartition(".")
        if last.isdigit():
            children.setdefault(parent, []).append(path)
    if not children:
        return ()
    most = max(len(kids) for kids in children.values())
    tied = [parent for parent, kids in children.items() if len(kids) == most]
    if len(tied) > 1:
        tied.sort(key=lambda parent: -_modules_inside(children[parent], order))  # stable: first seen on ties
    return tuple(children[tied[0]])


def _modules_inside(blocks: list[str], paths: list[str]) -> int:
    """How many of ``paths`` are one of ``blocks`` or lie inside one."""
    prefixes = tuple(f"{b}." for b in blocks)
    wanted = set(blocks)
    return sum(1 for p in paths if p in wanted or p.startswith(prefixes))


def entry(path: str, call: int | str) -> str:
    """The scope entry of call ``call`` of the module at ``path`` (what capture writes per node; the ATen
    tiers name calls by torch's module-stack keys)."""
    return f"{path}#{call}"


def entry_path(entry: str) -> str:
    """Module path of one scope entry (``"blocks.0.attn#1"`` -> ``"blocks.0.attn"``), for capture's own
    bookkeeping before the index exists."""
    return _split(entry)[0]


def _split(entry: str) -> tuple[str, int]:
    """``(path, call index)`` of a scope entry: ``"cell#3"`` (torch.fx), ``"cell#cell@3"`` (the ATen tiers name
    calls by torch's module-stack keys, the first call without ``@``)."""
    path, _, call = entry.rpartition("#")
    count = call.rpartition("@")[2] if "@" in call else call
    return path, int(count) if count.isdigit() else 0


def member(path: str, call: int | None) -> str:
    """How a plan names a chain member: the module's path, with ``#i`` when only its call ``i`` of each forward
    is meant (a module called in a loop)."""
    return path if call is None else f"{path}#{call}"


def member_call(name: str) -> tuple[str, int | None]:
    """``(path, call index or None)`` of a chain member's name (``member``)."""
    path, sep, call = name.rpartition("#")
    return (path, int(call)) if sep and call.isdigit() else (name, None)


def is_inside(path: str, ancestors: Iterable[str]) -> bool:
    """Whether module ``path`` is one of ``ancestors`` or lies inside one (``"blocks.0.fc"`` in ``"blocks.0"``)."""
    return any(path == a or path.startswith(a + ".") for a in ancestors)
