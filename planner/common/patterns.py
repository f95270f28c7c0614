"""The one meaning of a glob pattern in ckplan's options: module paths matched part by part (torch-free).

``units=``, ``must_save=`` and ``must_recompute=`` name modules and ops by patterns over dotted names
(``blocks.3.mlp.fc``). A pattern is split at dots like the name; ``*``, ``?`` and ``[...]`` match within
one part (shell rules, ``fnmatch``), and a part ``**`` matches any number of parts, none included. So
``blocks.*`` names each block and nothing inside one, ``blocks.*.mlp`` each block's MLP, ``**.fc1``
every ``fc1`` at any depth, and ``*softmax*`` any name of one part containing ``softmax`` (an op name,
a node name).
"""

from __future__ import annotations

import fnmatch
from functools import lru_cache


def matches(pattern: str, name: str) -> bool:
    """Whether dotted ``name`` matches ``pattern`` (see the module docstring)."""
    return _parts_match(tuple(pattern.split(".")), tuple(name.split(".")))


@lru_cache(maxsize=4096)
def _parts_match(pattern: tuple[str, ...], name: tuple[str, ...]) -> bool:
    if not pattern:
        return not name
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        return any(_parts_match(rest, name[i:]) for i in range(len(name) + 1))
    return bool(name) and fnmatch.fnmatchcase(name[0], head) and _parts_match(rest, name[1:])
