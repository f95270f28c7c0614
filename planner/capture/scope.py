"""Module scopes of graph nodes: which module calls a node ran inside (torch-free).

Capture writes, per node, the stack of module calls around it as ``"path#call_index"`` entries,
outermost first (``node.meta[SCOPE_KEY]``, copied into the profile as ``NodeCost.scope``). Every
later stage reads them through these helpers.
"""

from __future__ import annotations

SCOPE_KEY = "ckplan_scope"
"""``node.meta`` key: tuple of ``"path#call_index"`` strings, outermost first."""


def path_of(entry: str) -> str:
    """Module path of one scope entry (``"blocks.0.attn#1"`` -> ``"blocks.0.attn"``)."""
    return entry.rsplit("#", 1)[0]


def call_module_path(scope: tuple[str, ...]) -> str:
    """Module path of the innermost call in a scope (``""`` for the root)."""
    return path_of(scope[-1]) if scope else ""
