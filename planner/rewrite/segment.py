"""``Segment``: one checkpointed run of the graph, as the plan records it and the executors run it
(torch-free)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class Segment:
    """One checkpointed run of the graph."""

    nodes: tuple[str, ...]
    """Graph node names, in order."""
    module_paths: tuple[str, ...]
    """Modules whose calls lie wholly inside, outermost first; ``path:op`` for loose ops."""
    recompute_ms: float
    """Forward time re-run in backward, ms."""
    freed_bytes: int = 0
    """Activation bytes it stops keeping until backward, net of the inputs it keeps."""
    restore_buffers: tuple[str, ...] = ()
    """Buffers restored after recomputation (BatchNorm running statistics)."""
    saved_nodes: tuple[str, ...] = ()
    """Nodes whose outputs are kept, not re-run (selective checkpointing inside the segment)."""
    chain: tuple[str, ...] = ()
    """Plans run by module hooks: the module calls the segment consists of, consecutive siblings in call
    order; empty for a rewritten graph."""
    saved_modules: tuple[str, ...] = ()
    """Plans run by module hooks: the modules (one op each) whose outputs are kept."""
