"""Which modules are FSDP units: the ``fully_shard`` targets a distributed plan keeps as whole calls."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from planner.capture.calls import repeated_blocks
from planner.common.patterns import matches
from planner.errors import OptionError


def resolve_units(model: nn.Module, units: Sequence[str] | None) -> tuple[str, ...]:
    """FSDP units as module paths in model order: ``units`` (module paths or ``planner.common.patterns`` globs such
    as ``layers.*``), default the model's repeated blocks (``calls.repeated_blocks``).

    Raises:
        OptionError (a ValueError): a pattern matches no submodule, units are nested, or there is no default.
    """
    names = [name for name, _ in model.named_modules() if name]
    if units is None:
        blocks = repeated_blocks(names)
        if not blocks:
            raise OptionError(f"{type(model).__name__} has no container of numbered blocks to shard: pass "
                              "units=['path.of.block', ...] (module paths or globs such as 'layers.*')")
        return blocks
    if isinstance(units, str):
        units = [units]
    found: dict[str, None] = {}
    for pattern in units:
        matched = [n for n in names if matches(pattern, n)]
        if not matched:
            raise OptionError(f"unit {pattern!r} matches no submodule of {type(model).__name__}: name modules as "
                              "model.named_modules() does, e.g. 'blocks.0' or 'blocks.*'")
        found.update(dict.fromkeys(matched))
    for a in found:
        for b in found:
            if b.startswith(a + "."):
                raise OptionError(f"unit {b!r} is inside unit {a!r}: name disjoint modules as units")
    order = {name: i for i, name in enumerate(names)}
    return tuple(sorted(found, key=order.__getitem__))
