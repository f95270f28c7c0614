"""What one profiled training step cost, node by node, as plain data.

The profile stage (which needs torch) fills these records; every later stage
(regions, simulate, solve) reads only them, so planning can run without the
model, from a saved profile, and in tests on hand-written graphs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

LOSS_NODE = "loss"
"""Name of the pseudo-node appended after the graph: ``loss_fn(output)``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StorageCost:
    """One storage (block of memory) created during the forward pass."""

    nbytes: int
    """Size of the storage in bytes (shared by every view of it)."""
    producer: int
    """Index of the node that allocated it; -1 for model inputs."""
    autocast_cached: bool = False
    """A cast of a parameter held in autocast's cache: alive through the forward and the loss
    whatever the plan (the cache is cleared before backward)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeCost:
    """Measured cost of one graph node in an un-checkpointed training step."""

    name: str
    """fx node name (unique in the graph)."""
    kind: str
    """fx op kind (``call_module``, ``call_function``, ...) or ``loss``."""
    target: str
    """What the node calls, as text (module path, function name, method name)."""
    module_path: str
    """Path of the innermost module this node belongs to ("" for the root)."""
    scope: tuple[str, ...]
    """Module calls enclosing the node, outermost first, each ``path#call_index``."""
    fwd_ms: float
    """Forward time of the node in milliseconds (median over timing runs)."""
    bwd_ms: float
    """Backward time of the autograd nodes this node created, in milliseconds."""
    fwd_start_bytes: int
    """Live bytes on the device just before the node's forward ran."""
    fwd_peak_bytes: int
    """Peak live bytes on the device while the node's forward ran."""
    bwd_start_bytes: int | None
    """Live bytes just before its backward ran; None when it has no backward."""
    bwd_peak_bytes: int | None
    """Peak live bytes while its backward ran; None when it has no backward."""
    inputs: tuple[int, ...] = ()
    """Storages (indices into ``Profile.storages``) of the tensors it reads."""
    outputs: tuple[int, ...] = ()
    """Storages it allocated (its outputs and internal tensors)."""
    saves: tuple[int, ...] = ()
    """Storages autograd saved for this node's backward (parameters excluded)."""
    mutates: tuple[int, ...] = ()
    """Activation storages it modified in place."""
    mutated_buffers: tuple[str, ...] = ()
    """Fully qualified names of module buffers it modified (BatchNorm stats)."""
    mutated_buffer_bytes: int = 0
    """Bytes of those buffers (a checkpointed segment copies them while it is re-run)."""
    eager_excess_bytes: int = 0
    """Extra bytes the model's own forward keeps alive during this node (Python locals)."""
    checkpointable: bool = True
    """False for nodes that can never be inside a segment (the loss)."""
    aten_ops: int = -1
    """ATen ops its forward dispatches, views included (each costs selective checkpointing's dispatch
    modes a Python call); -1 when unknown (profiles saved before this field)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Profile:
    """Everything the planner knows about one training step of one model."""

    nodes: tuple[NodeCost, ...]
    """Graph nodes in execution order, the loss pseudo-node last."""
    storages: tuple[StorageCost, ...]
    """Activation storages (model inputs included, parameters excluded)."""
    device: str
    """Device the profile was measured on (``cpu``, ``cuda:0``...)."""
    torch_version: str
    input_shapes: tuple[str, ...]
    """``name: dtype[shape]`` of each model input."""
    param_bytes: int
    """Bytes of parameters and buffers resident during the step."""
    grad_bytes: int
    """Bytes of parameter gradients after backward."""
    step_fwd_ms: float
    """Forward time of a whole un-instrumented step (graph + loss), ms."""
    step_bwd_ms: float
    """Backward time of a whole un-instrumented step, ms."""
    baseline_peak_bytes: int = field(default=0)
    """Peak live bytes of the profiled un-checkpointed step."""
    checkpoint_overhead_ms: float = field(default=0.0)
    """Time one ``checkpoint`` call adds beyond re-running its ops (holders, RNG state), ms."""
    sac_op_us: float = field(default=-1.0)
    """Time selective checkpointing's dispatch modes add per ATen op of this graph (forward and
    re-run), measured on it; -1 when not measured (estimated or older profiles)."""
    fingerprint: str = ""
    """Structure hash of the captured graph (``Captured.fingerprint``) the nodes belong to."""
    capture_method: str = ""
    """How that graph was captured (``torch.fx.symbolic_trace``, ``torch.export (non-strict)``...)."""
    estimated_for: str = ""
    """Name of the device spec whose roofline gave the times, with memory from meta tensors;
    ``""`` when the step was measured on ``device``."""

    @property
    def step_ms(self) -> float:
        """Forward plus backward time of one un-checkpointed step, ms."""
        return self.step_fwd_ms + self.step_bwd_ms

    def node_index(self) -> dict[str, int]:
        """Map from node name to position."""
        return {n.name: i for i, n in enumerate(self.nodes)}

    def save(self, path: str) -> None:
        """Writes the profile as JSON (schema in docs/profiles.md); read it back with ``load_profile``."""
        from planner.profile_io import save_profile

        save_profile(self, path)
