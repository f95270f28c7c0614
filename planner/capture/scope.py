"""Module paths and the module scopes of graph nodes (torch-free).

Capture writes, per node, the stack of module calls around it as ``"path#call_index"`` entries,
outermost first (``node.meta[SCOPE_KEY]``, copied into the profile as ``NodeCost.scope``). Every
later stage reads them through these helpers. ``repeated_blocks`` finds the model's repeated blocks
among module paths, for capture, the regions and FSDP's default units alike.
"""

from __future__ import annotations

from typing import Iterable

SCOPE_KEY = "ckplan_scope"
"""``node.meta`` key: tuple of ``"path#call_index"`` strings, outermost first."""


def path_of(entry: str) -> str:
    """Module path of one scope entry (``"blocks.0.attn#1"`` -> ``"blocks.0.attn"``)."""
    return entry.rsplit("#", 1)[0]


def call_module_path(scope: tuple[str, ...]) -> str:
    """Module path of the innermost call in a scope (``""`` for the root)."""
    return path_of(scope[-1]) if scope else ""


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
