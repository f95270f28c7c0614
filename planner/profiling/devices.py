"""Device specs: what a device can do, from its datasheet, for planning on a machine without it.

The specs ship inside the package (``planner/device_specs/*.json``, one file per device, each
naming the datasheet its numbers come from) so an installed ckplan finds them; a spec file of
your own is used by passing its path. ``profiles/`` at the top of the repository is for
profiles measured on real devices (docs/profiles.md). Torch-free.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path
from typing import TypeGuard

from planner.common.checked_json import check_record, read_json, record_from_json
from planner.errors import OptionError, ProfileFileError
from planner.profiling.record import Profile

SPEC_DIR = Path(__file__).resolve().parent / "device_specs"
"""Where the bundled device specs live."""
SPEC_SCHEMA = "ckplan.device"
SPEC_VERSION = 1
MATMUL_DTYPES = ("float64", "float32", "tf32", "bfloat16", "float16", "float8")
"""Keys of ``peak_dense_tflops``: the precision a matmul or convolution computes in."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceSpec:
    """Peak rates and capacity of one device (dense, no sparsity)."""

    name: str
    """Short name used as ``device=`` (``h100``, ``generic-cpu``)."""
    description: str
    """The exact part (``NVIDIA H100 SXM5 80GB``)."""
    kind: str
    """``gpu`` or ``cpu``."""
    peak_dense_tflops: dict[str, float]
    """Peak dense matmul rate per precision (keys from ``MATMUL_DTYPES``), 10^12 FLOP/s."""
    memory_bytes: int
    """Memory capacity in bytes (GPU datasheets' "GB" of HBM/GDDR are GiB)."""
    memory_bandwidth_gb_per_s: float
    """Peak memory bandwidth, 10^9 bytes/s."""
    op_overhead_us: float
    """Fixed cost of one eager ATen op (dispatch and launch), microseconds (a modelling constant)."""
    checkpoint_overhead_us: float
    """Fixed cost of one ``torch.utils.checkpoint`` call, microseconds (a modelling constant)."""
    source: str
    """Where the numbers come from (datasheet and column)."""
    sac_op_us: float | None = None
    """What selective checkpointing's dispatch modes add per ATen op of a segment, microseconds (a
    modelling constant, see ``overhead_source``); None in spec files that do not give it."""
    interconnect_gb_per_s: float | None = None
    """Bandwidth of the link between the devices of one node in each direction, 10^9 bytes/s (NVLink): what a
    tensor-parallel all-reduce moves at; None: collectives are not timed."""
    device_to_host_gb_per_s: float | None = None
    """Bandwidth of a copy from device memory to pinned host memory, 10^9 bytes/s (what an activation offloaded to
    the host leaves at); None where the spec gives no host link (a CPU: nothing to offload to)."""
    host_to_device_gb_per_s: float | None = None
    """Bandwidth of a copy from pinned host memory back to the device, 10^9 bytes/s; None as above."""
    gpus_per_host: int | None = None
    """Devices that share one host's memory (8 in a DGX H100; 1 per GH200 superchip, whose Grace CPU and LPDDR5X
    serve its one GPU): the ranks whose offloads share that memory's bandwidth and size; None: not given."""
    host_memory_bytes: int | None = None
    """Host memory of one host, bytes; None: not given (offloads are bounded by ``host_budget`` only)."""
    host_memory_bandwidth_gb_per_s: float | None = None
    """Peak bandwidth of one host's memory, 10^9 bytes/s, which the copies of its devices share; None: not given."""
    host_source: str | None = None
    """Where the host figures come from."""

    @property
    def host_link(self) -> tuple[float, float] | None:
        """``(device_to_host, host_to_device)`` GB/s, or None where the spec gives no host link."""
        if self.device_to_host_gb_per_s is None or self.host_to_device_gb_per_s is None:
            return None
        return self.device_to_host_gb_per_s, self.host_to_device_gb_per_s

    def flops_per_s(self, precision: str) -> float:
        """Peak FLOP/s of a matmul in ``precision``; float32's when the device has no faster unit for it."""
        tflops = self.peak_dense_tflops.get(precision) or self.peak_dense_tflops["float32"]
        return tflops * 1e12

    @property
    def bytes_per_s(self) -> float:
        return self.memory_bandwidth_gb_per_s * 1e9


def device_names() -> list[str]:
    """Names of the bundled device specs, sorted."""
    return sorted(p.stem for p in SPEC_DIR.glob("*.json"))


def is_device_spec(device: object) -> TypeGuard[str | Path]:
    """True when ``device`` names a bundled spec or a spec file (not a torch device like ``cuda:0``)."""
    return isinstance(device, (str, Path)) and (str(device) in device_names() or str(device).endswith(".json"))


def load_device(device: str | Path) -> DeviceSpec:
    """The spec named ``device`` (``h100``...) or stored in the JSON file at path ``device``.

    Raises:
        OptionError (a ValueError): an unknown name (the message lists the known ones).
        ProfileFileError: a spec file that is missing, not JSON or lacks a field.
    """
    text = str(device)
    if text.endswith(".json"):
        path = Path(text)
    elif text in device_names():
        path = SPEC_DIR / f"{text}.json"
    else:
        raise OptionError(f"unknown device {text!r}: use one of {', '.join(device_names())}, a device spec "
                          "file (.json, see docs/profiles.md), or leave device unset to measure where the model is")
    try:
        data = read_json(path)
    except OSError as exc:
        raise ProfileFileError(f"cannot read device spec {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ProfileFileError(f"device spec {path} is not a ckplan device spec: {exc}") from None
    if not isinstance(data, dict) or data.get("schema") != SPEC_SCHEMA or data.get("version") != SPEC_VERSION:
        raise ProfileFileError(f"{path} is not a ckplan device spec (expected schema {SPEC_SCHEMA!r} "
                               f"version {SPEC_VERSION}); see docs/profiles.md")
    try:
        spec = record_from_json(DeviceSpec, data, "spec")
        check_record(spec, where="spec")
    except KeyError as exc:
        raise ProfileFileError(f"device spec {path} lacks the field {exc.args[0]!r}; see docs/profiles.md") from None
    except (TypeError, ValueError) as exc:
        raise ProfileFileError(f"device spec {path} has a malformed field ({exc}); see docs/profiles.md") from None
    links = (spec.device_to_host_gb_per_s, spec.host_to_device_gb_per_s)
    if (links[0] is None) != (links[1] is None) or any(link is not None and link <= 0 for link in links):
        raise ProfileFileError(f"device spec {path} needs both device_to_host_gb_per_s and host_to_device_gb_per_s, "
                               "each positive, or neither (no host link)")
    host = (spec.gpus_per_host, spec.host_memory_bytes, spec.host_memory_bandwidth_gb_per_s)
    if any(value is not None and value <= 0 for value in host):
        raise ProfileFileError(f"device spec {path}: gpus_per_host, host_memory_bytes and "
                               "host_memory_bandwidth_gb_per_s must each be positive where given")
    if "float32" not in spec.peak_dense_tflops or spec.memory_bandwidth_gb_per_s <= 0:
        raise ProfileFileError(f"device spec {path} needs a float32 rate in peak_dense_tflops and a positive "
                               "memory_bandwidth_gb_per_s")
    return spec


DEFAULT_SAC_OP_US = 44.0
"""SAC's per-op cost when neither the profile nor a device spec gives one, microseconds: what the
profile measured on the GPT and ResNet examples on the project's 2-core CPU (docs/selective.md).
It is charged only to segments that keep op outputs, so a high value errs towards whole segments."""


class SacCostSource(str, enum.Enum):
    """Where the per-op SAC cost a plan was made with comes from (``Plan.sac_cost_source``)."""

    MEASURED = "measured"
    """Measured on the model when it was profiled (``Profile.sac_op_us``)."""
    DEVICE_SPEC = "device_spec"
    """The device spec's modelling constant (estimated profiles, or a profile that could not measure it)."""
    DEFAULT = "default"
    """``DEFAULT_SAC_OP_US``: neither the profile nor a device spec gives it."""

    def __str__(self) -> str:
        return self.value

    @property
    def label(self) -> str:
        """How ``--explain`` says it."""
        return {"measured": "measured on the model", "device_spec": "the device spec's estimate",
                "default": "ckplan's default (not measured)"}[self.value]


@dataclass(frozen=True, kw_only=True, slots=True)
class SacCost:
    """The per-op SAC cost to plan with, and its provenance."""

    op_us: float
    """Time SAC's dispatch modes add per ATen op of a segment that keeps op outputs, microseconds."""
    source: SacCostSource
    """Where ``op_us`` comes from."""
    host_us: float | None = None
    """For a GPU spec's estimate, the host's own cost per op (``DeviceSpec.op_overhead_us``): the device runs
    kernels queued behind the host, so SAC's host time costs only where the host falls behind
    (``planner.memory.build``); None where ``op_us`` is simply added (a CPU, or measured)."""


def spec_for(profile: Profile, device: object) -> DeviceSpec | None:
    """The device spec a plan from ``profile`` is made for: the ``device=`` option's when it names one, else the
    bundled spec the profile was estimated for; None for a profile measured on a device (or estimated for a spec
    file that is not at hand)."""
    if is_device_spec(device):
        return load_device(device)
    return load_device(profile.estimated_for) if profile.estimated_for in device_names() else None


def sac_op_cost(profile: Profile, spec: DeviceSpec | None) -> SacCost:
    """The one place that decides SAC's per-op cost for planning: the profile's measurement when it has
    one (made on the device it describes), else the device spec's (``spec_for``), else ``DEFAULT_SAC_OP_US``.
    Nothing is measured on the machine doing the planning, so a profile gives the same plans everywhere."""
    if profile.sac_op_us is not None:
        return SacCost(op_us=profile.sac_op_us, source=SacCostSource.MEASURED)
    if spec is not None and spec.sac_op_us is not None:
        return SacCost(op_us=spec.sac_op_us, source=SacCostSource.DEVICE_SPEC,
                       host_us=spec.op_overhead_us if spec.kind == "gpu" else None)
    return SacCost(op_us=DEFAULT_SAC_OP_US, source=SacCostSource.DEFAULT)

