"""What the executor that will run a plan allows, as plain data the regions, the memory model and the
solvers read (torch-free).

The executor (``planner.rewrite.executor``) decides these rules for the model it was captured as; this
stage never asks how the model was captured, it reads ``SegmentRules``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class Span:
    """A run of nodes the executor can checkpoint as one segment: a chain of module calls."""

    lo: int
    """First node."""
    hi: int
    """One past the last node."""
    members: tuple[str, ...]
    """Module paths of the calls it consists of, in order (siblings)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SegmentRules:
    """Where segments may lie, what they may keep, and which module code they run."""

    spans: tuple[Span, ...] | None = None
    """The only node runs that may be segments (chains of module calls, for plans run by module hooks);
    None: any run of checkpointable nodes (a rewritten graph)."""
    savable: frozenset[int] | None = None
    """Nodes whose outputs a segment can keep (selective checkpointing); None: every node the memory
    model can save exactly (``planner.memory.saves.cacheable``)."""
    opens_modules: bool = True
    """True: a segment runs the traced code of the module calls it cuts or holds, so their Python locals
    follow the plan (``planner.memory.excess``); False: every module runs its own forward, in re-runs too
    (``MemoryModel.rerun_excess``)."""
    refinable: bool = True
    """Whether finer chunkings can hold other plans (False when FSDP units captured as single calls fix
    where segments can lie)."""


ANY_RUN = SegmentRules()
"""The rules of a rewritten graph without a graph to ask: any run of nodes, any exact save, modules opened
(hand-made profiles in tests and benchmarks)."""
