"""What a plan offloads, as the executor finds it (``planner.rewrite.offload`` runs it): each offloaded storage named
by the op that makes it, its occurrence among the forward's ops of that name and which of the op's outputs it is,
with what the model predicts of the copies. Plain data, saved with the plan."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from planner.common.checked_json import as_list, record_from_json


@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadTarget:
    """One offloaded storage, as the executor finds it: the op that makes it and which of its outputs it is."""

    kernel: str
    """Name of the op (``planner.capture.ops.kernel_name``)."""
    occurrence: int
    """Its occurrence among the forward's ops of that name, from 0."""
    nbytes: int
    """Bytes of the storage at the planned shape."""
    group: int
    """Reload group: 0 is brought back first in backward."""
    cached: bool = False
    """Held by selective checkpointing's cache: copied out when made, its bytes freed in place where its segment's
    forward ends, brought back in place before the segment is re-run."""
    output: int | None = None
    """Which output of the op it is (its index among ``tree_leaves`` of what the op returns): found so at any
    shape. None (a profile that did not record it): the op's output of ``nbytes`` bytes, found at the planned
    shape only."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadSpec:
    """What a plan offloads and what the model predicts of it."""

    targets: tuple[OffloadTarget, ...]
    storages: int
    """How many storages are offloaded (a storage made by a node of several ops has a target per op)."""
    offloaded_bytes: int
    """Bytes copied to host memory each step (pinned host memory the plan holds)."""
    exposed_ms: float
    """Time the copies add to the step (reloads waited for; every copy on a CPU), ms."""
    d2h_busy_ms: float
    """Time the device-to-host link is busy in forward, ms."""
    forward_ms: float
    """The forward's compute time the copies run beside, ms."""
    h2d_busy_ms: float
    """Time the host-to-device link is busy in backward, ms."""
    backward_ms: float
    """The backward's compute time (re-runs included) the reloads run beside, ms."""
    link: str = ""
    """Where the link's rates come from."""

    @classmethod
    def from_dict(cls, data: Any, where: str) -> OffloadSpec:
        """The spec ``dataclasses.asdict`` wrote (a saved plan's), checked field by field.

        Raises:
            TypeError, ValueError, KeyError: a malformed field, named from ``where``.
        """
        targets = tuple(record_from_json(OffloadTarget, t, f"{where}.targets[{i}]")
                        for i, t in enumerate(as_list(data["targets"], f"{where}.targets")))
        return record_from_json(cls, {**data, "targets": targets}, where)

    @property
    def groups(self) -> int:
        return 1 + max((t.group for t in self.targets), default=-1)

    def link_busy(self) -> str:
        """How busy the host link is, in words: the share of the forward it copies out, of the backward it
        copies back."""
        def share(part: float, whole: float) -> str:
            return f"{100 * part / whole:.0f}%" if whole > 0 else "-"
        return (f"host link busy {share(self.d2h_busy_ms, self.forward_ms)} of the forward out, "
                f"{share(self.h2d_busy_ms, self.backward_ms)} of the backward back")


def targets_of(kernels: Sequence[Sequence[str]], producers: Sequence[int], sizes: Sequence[int],
               groups: Sequence[int], ops: Sequence[int | None], cached: Sequence[bool],
               outputs: Sequence[int | None]) -> tuple[OffloadTarget, ...]:
    """The targets of offloaded storages made by nodes ``producers`` (per node, ``kernels``: its fresh-memory ops in
    order; ``ops``: which of the producer's ops made each storage; ``outputs``: which output of that op), each op
    named by its occurrence among the forward's ops of that name; ``cached``: per storage, held by selective
    checkpointing's cache. Where the op is not known, every op of the producer is a target: the storage is the
    output of that size of whichever of them makes it."""
    named: dict[int, list[tuple[str, int]]] = {}
    seen: Counter[str] = Counter()
    wanted = set(producers)
    for i, names in enumerate(kernels):
        for name in names:
            if i in wanted:
                named.setdefault(i, []).append((name, seen[name]))
            seen[name] += 1
    targets = []
    for p, n, g, op, c, out in zip(producers, sizes, groups, ops, cached, outputs):
        mine = named.get(p, [])
        known = op is not None and op < len(mine)
        for name, k in ([mine[op]] if known else mine):
            targets.append(OffloadTarget(kernel=name, occurrence=k, nbytes=int(n), group=int(g), cached=bool(c),
                                         output=out if known else None))
    return tuple(targets)
