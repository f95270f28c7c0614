"""What one profiled training step cost, node by node, as plain data, and its JSON file.

The profile stage (which needs torch) fills these records; every later stage
(regions, simulate, solve) reads only them, so planning can run without the
model, from a saved profile (profile once on the target GPU, plan anywhere afterwards),
and in tests on hand-written graphs.

The file's schema is versioned and documented in docs/profiles.md. Reading never trusts the
file: a missing file, broken JSON, another schema or version, a missing field or one of the wrong
type is one ``ProfileFileError`` naming the file and the problem. Torch-free.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from planner.capture.calls import CallIndex
from planner.capture.method import CaptureMethod
from planner.common.checked_json import as_list, check_record, read_json, record_from_json
from planner.errors import ProfileFileError

LOSS_NODE = "loss"
"""Name of the pseudo-node appended after the graph: ``loss_fn(output)``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StorageCost:
    """One storage (block of memory) created during the forward pass."""

    nbytes: int
    """Size of the storage in bytes (shared by every view of it)."""
    producer: int
    """Index of the node that allocated it; -1 for model inputs."""
    op: int | None = None
    """Which of the producer's fresh-memory ops (``NodeCost.kernels``, from 0) made it; None when unknown (model
    inputs, profiles saved before it was recorded)."""
    output: int | None = None
    """Which output of that op it is: its index among ``torch.utils._pytree.tree_leaves`` of what the op returned;
    None when unknown (as ``op``)."""
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
    """Forward time of the node in milliseconds (the fastest of the timed steps)."""
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
    fwd_hidden_bytes: int = 0
    """Bytes its forward's ops allocate inside themselves beyond ``fwd_peak_bytes`` at the allocator's peak (oneDNN's
    reorders in a CPU convolution, cuDNN and cuBLAS workspaces): the dispatcher never sees them, the allocator
    does, so its forward peaks at ``fwd_peak_bytes + fwd_hidden_bytes`` there; 0 where none or unknown. Negative
    where the live storages, counted under a dispatch mode, read more than a plain step allocates (autograd sums
    gradients out of place under any Python dispatch mode: ``planner.profiling.windows``)."""
    bwd_hidden_bytes: int = 0
    """The same for its backward: its allocator peak is ``bwd_peak_bytes + bwd_hidden_bytes``."""
    bwd_start_hidden_bytes: int = 0
    """What the allocator held beyond the live storages when its backward started (scalars that autograd saved
    from Python numbers): where a segment re-run just before this node's backward starts from."""
    bwd_expanded_grad_bytes: int = 0
    """The dense size of the largest expanded gradient of the loss's its backward received (a stride-0 broadcast of
    one value, what the sum of the outputs gives each output, passed on unchanged by the ops after it); an op such
    as a matmul makes it dense inside itself, in ``bwd_hidden_bytes``. A pipeline stage receives its output's
    gradient dense instead, in a buffer the runtime holds (``planner.planning.pipelined.received_gradient``). 0 where
    none or unknown."""
    bwd_grad_bytes: int | None = None
    """Bytes of parameter gradients alive just before its backward ran (those the backward of the nodes before
    it made; part of ``bwd_start_bytes``); None when unknown or it has no backward."""
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
    stop_peak_bytes: int | None = None
    """Peak live bytes of its forward up to the moment autograd saved the last tensor it saves. A
    checkpoint's re-run that ends at this node stops right there (torch stops re-running once every
    saved tensor is back), before anything the node allocates later; None when unknown (a node that
    saves nothing, hand-made profiles)."""
    aten_ops: int | None = None
    """ATen ops its forward dispatches, views included (each costs selective checkpointing's dispatch
    modes a Python call); None when unknown (hand-made profiles)."""
    kernels: tuple[str, ...] = ()
    """Names of the ops its forward dispatches below autograd that write fresh memory, in order
    (``planner.capture.ops``): what selective checkpointing sees of it. A plan run by module hooks keeps this
    node by keeping these ops, each named by its occurrence among same-named ops of the segment."""
    random: bool = True
    """Its forward draws random numbers (dropout): a checkpointed segment holding it stashes the RNG state to
    re-run it alike. True when unknown (profiles saved before it was recorded), which is always safe."""

    @property
    def fwd_allocator_peak_bytes(self) -> int:
        """Its forward's peak at the allocator: the live storages' peak plus what its ops allocate inside."""
        return self.fwd_peak_bytes + self.fwd_hidden_bytes

    @property
    def bwd_allocator_peak_bytes(self) -> int | None:
        """Its backward's peak at the allocator; None when it has no backward."""
        return None if self.bwd_peak_bytes is None else self.bwd_peak_bytes + self.bwd_hidden_bytes


SIGNED = ("fwd_hidden_bytes", "bwd_hidden_bytes", "bwd_start_hidden_bytes")
"""Amounts a profile may hold below zero: what the allocator held beyond the live storages is negative where the
storage-counting dispatch mode made autograd allocate more than a plain step does (``planner.profiling.windows``)."""


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
    rng_state_bytes: int = 0
    """Bytes of RNG state on the device that ``torch.utils.checkpoint`` stashes for a segment drawing random
    numbers (a CPU's generator state, 5056 B; 0 on a GPU, whose states it reads into host memory)."""
    baseline_peak_bytes: int = field(default=0)
    """Peak bytes of the profiled un-checkpointed step at the allocator (live storages, and what ops allocate
    inside themselves)."""
    end_bytes: int | None = None
    """Live bytes right after the step's backward: parameters and buffers, gradients, the inputs, the output
    when kept (where the optimizer steps); None when unknown."""
    keep_output: bool = True
    """Whether the profiled step kept the model's output referenced through backward (a plain loop:
    ``out = model(x); loss_fn(out).backward()``) or dropped it first (Hugging Face Trainer)."""
    checkpoint_overhead_ms: float = field(default=0.0)
    """Time one ``checkpoint`` call adds beyond re-running its ops (holders, RNG state), ms."""
    sac_op_us: float | None = None
    """Time selective checkpointing's dispatch modes add per ATen op of this graph (forward and
    re-run), measured on it, microseconds; None when not measured (estimated profiles, autocast):
    the planner then takes it from the device spec (``devices.sac_op_cost``)."""
    fingerprint: str = ""
    """Structure hash of the captured graph (``Captured.fingerprint``) the nodes belong to."""
    capture_method: CaptureMethod | None = None
    """How that graph was captured; None when unknown (hand-made profiles)."""
    estimated_for: str = ""
    """Name of the device spec whose roofline gave the times, with memory from meta tensors;
    ``""`` when the step was measured on ``device``."""
    pieces: int = 1
    """How many pieces the measured step ran in: 1 when it ran whole (memory and times measured); more
    when it did not fit where the model is (memory from a meta-tensor replay, times measured piece by
    piece, ``planner.profiling.fitting``)."""
    input_bytes: int = 0
    """Bytes of the step's inputs (the example batch), which a loop that holds several micro-batches at once holds
    more of (``planner.common.loop.TrainingLoop.batches_held``)."""
    profile_peak_bytes: int | None = None
    """Peak bytes the profiling itself held on ``device``: the un-checkpointed peak when the step ran
    whole, the largest piece's otherwise; None for an estimate (nothing ran)."""
    d2h_gb_per_s: float | None = None
    """Copies from ``device`` to pinned host memory, GB/s: measured when the step was profiled, the device spec's
    for an estimate; None when unknown (a profile saved before it was recorded, a spec without a host link)."""
    h2d_gb_per_s: float | None = None
    """Copies from pinned host memory to ``device``, GB/s (as ``d2h_gb_per_s``)."""
    calls: CallIndex = field(init=False, repr=False, compare=False)
    """The module calls of the graph (built from the nodes' scopes, not stored in the file)."""

    def __post_init__(self) -> None:
        scopes = [n.scope if isinstance(n.scope, tuple) and all(isinstance(e, str) for e in n.scope) else ()
                  for n in self.nodes]  # a malformed file is refused by check_record, naming the field
        object.__setattr__(self, "calls", CallIndex.from_scopes(scopes))

    @property
    def step_ms(self) -> float:
        """Forward plus backward time of one un-checkpointed step, ms."""
        return self.step_fwd_ms + self.step_bwd_ms

    def node_index(self) -> dict[str, int]:
        """Map from node name to position."""
        return {n.name: i for i, n in enumerate(self.nodes)}

    def save(self, path: str) -> None:
        """Writes the profile as JSON (schema in docs/profiles.md); read it back with ``load_profile``."""
        save_profile(self, path)


SCHEMA = "ckplan.profile"
"""Value of the file's ``schema`` key."""
SCHEMA_VERSION = 1
"""Version this ckplan writes and reads; bumped when a field changes meaning or is removed."""



def profile_to_dict(prof: Profile) -> dict[str, Any]:
    """The JSON-ready form of a profile: run-level fields, then ``storages`` and ``nodes``."""
    data: dict[str, Any] = {"schema": SCHEMA, "version": SCHEMA_VERSION}
    for f in fields(Profile):
        if f.init and f.name not in ("nodes", "storages"):
            value = getattr(prof, f.name)
            data[f.name] = list(value) if isinstance(value, tuple) else value.value if isinstance(
                value, CaptureMethod) else value
    data["storages"] = [asdict(s) for s in prof.storages]
    data["nodes"] = [{k: list(v) if isinstance(v, tuple) else v for k, v in asdict(n).items()} for n in prof.nodes]
    return data


def save_profile(prof: Profile, path: str | Path) -> None:
    """Writes ``prof`` as JSON to ``path`` (one node per line, so diffs stay readable)."""
    data = profile_to_dict(prof)
    nodes, storages = data.pop("nodes"), data.pop("storages")
    head = json.dumps(data, indent=1)[:-2]
    rows = ",\n".join(f"  {json.dumps(n, separators=(',', ':'))}" for n in nodes)
    stores = ",\n".join(f"  {json.dumps(s, separators=(',', ':'))}" for s in storages)
    Path(path).write_text(f"{head},\n \"storages\": [\n{stores}\n ],\n \"nodes\": [\n{rows}\n ]\n}}\n")


def load_profile(path: str | Path) -> Profile:
    """Reads a profile written by ``Profile.save``. The file is plain JSON and is never executed.

    Raises:
        ProfileFileError: the file is missing, not JSON, of another schema or version, or lacks a
            field or holds one of the wrong type; the message names the file and what is wrong.
    """
    try:
        data = read_json(path)
    except OSError as exc:
        raise ProfileFileError(f"cannot read profile {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ProfileFileError(f"{path} is not a ckplan profile: {exc}; pass a file written by Profile.save, "
                               "or profile the model again") from None
    return profile_from_dict(data, source=str(path))


def profile_from_dict(data: Any, *, source: str = "profile") -> Profile:
    """The ``Profile`` a dict of ``profile_to_dict`` describes (errors name ``source``)."""
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        found = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise ProfileFileError(f"{source} is not a ckplan profile (schema {found!r}, expected {SCHEMA!r})")
    if data.get("version") != SCHEMA_VERSION:
        raise ProfileFileError(f"{source} has profile schema version {data.get('version')!r}; this ckplan reads "
                               f"version {SCHEMA_VERSION}: profile the model again with this version")
    try:
        storages = tuple(record_from_json(StorageCost, s, f"profile.storages[{i}]")
                         for i, s in enumerate(as_list(data["storages"], "profile.storages")))
        nodes = tuple(record_from_json(NodeCost, n, f"profile.nodes[{i}]")
                      for i, n in enumerate(as_list(data["nodes"], "profile.nodes")))
        run = {k: v for k, v in data.items() if k not in ("nodes", "storages")}
        prof = record_from_json(Profile, {**run, "nodes": nodes, "storages": storages}, "profile",
                                convert={"capture_method": CaptureMethod})
        check_record(prof, where="profile", signed=SIGNED)
    except KeyError as exc:
        raise ProfileFileError(f"{source} lacks the field {exc.args[0]!r}; the file is incomplete or was "
                               "edited: profile the model again") from None
    except (TypeError, ValueError, AttributeError, OverflowError) as exc:
        raise ProfileFileError(f"{source} has a malformed record ({exc}); profile the model again") from None
    _check_indices(prof, source)
    return prof


def _check_indices(prof: Profile, source: str) -> None:
    """Storage indices and producers point inside the profile (a planner given garbage plans garbage)."""
    n_storages, n_nodes = len(prof.storages), len(prof.nodes)
    for node in prof.nodes:
        for key in ("inputs", "outputs", "saves", "mutates"):
            bad = [s for s in getattr(node, key) if not (isinstance(s, int) and 0 <= s < n_storages)]
            if bad:
                raise ProfileFileError(f"{source}: node {node.name!r} lists {key} storage {bad[0]!r}, but the "
                                       f"profile has {n_storages} storages; the file is corrupt: profile again")
    for i, st in enumerate(prof.storages):
        if not -1 <= st.producer < n_nodes:
            raise ProfileFileError(f"{source}: storage {i} names producer node {st.producer}, but the profile "
                                   f"has {n_nodes} nodes; the file is corrupt: profile again")
    # The lists must agree with each other: a storage is read and saved only once it exists, and
    # its producer lists it among its outputs.
    for i, node in enumerate(prof.nodes):
        for key in ("inputs", "saves", "mutates"):
            late = [s for s in getattr(node, key) if prof.storages[s].producer > i]
            if late:
                raise ProfileFileError(f"{source}: node {node.name!r} lists {key} storage {late[0]}, which node "
                                       f"{prof.storages[late[0]].producer} produces later; the file is corrupt: "
                                       "profile again")
        touched = set(node.inputs) | set(node.outputs)  # autograd saves, and ops modify, what they touch
        unread = [s for s in (*node.saves, *node.mutates) if s not in touched]
        if unread:
            raise ProfileFileError(f"{source}: node {node.name!r} saves or modifies storage {unread[0]}, which it "
                                   "neither reads nor produces; the file is corrupt: profile again")
        foreign = [s for s in node.outputs if prof.storages[s].producer != i]
        if foreign:
            raise ProfileFileError(f"{source}: node {node.name!r} lists output storage {foreign[0]}, whose producer "
                                   f"is node {prof.storages[foreign[0]].producer}; the file is corrupt: profile again")
    if len({node.name for node in prof.nodes}) != n_nodes:
        raise ProfileFileError(f"{source}: two nodes share a name; the file is corrupt: profile again")
