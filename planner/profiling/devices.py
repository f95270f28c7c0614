"""Device specs: what a device can do, from its datasheet, for planning on a machine without it.

The specs ship inside the package (``planner/device_specs/*.json``, one file per device, each
naming the datasheet its numbers come from) so an installed ckplan finds them; a spec file of
your own is used by passing its path. ``profiles/`` at the top of the repository is for
profiles measured on real devices (docs/profiles.md). Torch-free.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from planner.errors import ProfileFileError

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


def is_device_spec(device: object) -> bool:
    """True when ``device`` names a bundled spec or a spec file (not a torch device like ``cuda:0``)."""
    return isinstance(device, (str, Path)) and (str(device) in device_names() or str(device).endswith(".json"))


def load_device(device: str | Path) -> DeviceSpec:
    """The spec named ``device`` (``h100``...) or stored in the JSON file at path ``device``.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
        ProfileFileError: a spec file that is missing, not JSON or lacks a field.
    """
    text = str(device)
    if text.endswith(".json"):
        path = Path(text)
    elif text in device_names():
        path = SPEC_DIR / f"{text}.json"
    else:
        raise ValueError(f"unknown device {text!r}: use one of {', '.join(device_names())}, a device spec "
                         "file (.json, see docs/profiles.md), or leave device unset to measure where the model is")
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ProfileFileError(f"cannot read device spec {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ProfileFileError(f"device spec {path} is not valid JSON (line {exc.lineno}: {exc.msg})") from None
    if not isinstance(data, dict) or data.get("schema") != SPEC_SCHEMA or data.get("version") != SPEC_VERSION:
        raise ProfileFileError(f"{path} is not a ckplan device spec (expected schema {SPEC_SCHEMA!r} "
                               f"version {SPEC_VERSION}); see docs/profiles.md")
    try:
        spec = DeviceSpec(**{k: data[k] for k in DeviceSpec.__dataclass_fields__})
    except KeyError as exc:
        raise ProfileFileError(f"device spec {path} lacks the field {exc.args[0]!r}; see docs/profiles.md") from None
    if "float32" not in spec.peak_dense_tflops or spec.memory_bandwidth_gb_per_s <= 0:
        raise ProfileFileError(f"device spec {path} needs a float32 rate in peak_dense_tflops and a positive "
                               "memory_bandwidth_gb_per_s")
    return spec
