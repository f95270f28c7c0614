"""Profiles as JSON files: profile once (on the target GPU), plan anywhere afterwards.

The schema is versioned and documented in docs/profiles.md. Reading never trusts the
file: a missing file, broken JSON, another schema or version, or a missing field is one
``ProfileFileError`` naming the file and the problem. Torch-free, like ``costs.py``.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, fields
from pathlib import Path
from typing import Any

from planner.costs import NodeCost, Profile, StorageCost
from planner.errors import ProfileFileError

SCHEMA = "ckplan.profile"
"""Value of the file's ``schema`` key."""
SCHEMA_VERSION = 1
"""Version this ckplan writes and reads; bumped when a field changes meaning or is removed."""

_TUPLE_FIELDS = {"scope", "inputs", "outputs", "saves", "mutates", "mutated_buffers"}


def profile_to_dict(prof: Profile) -> dict[str, Any]:
    """The JSON-ready form of a profile: run-level fields, then ``storages`` and ``nodes``."""
    data: dict[str, Any] = {"schema": SCHEMA, "version": SCHEMA_VERSION}
    for f in fields(Profile):
        if f.name not in ("nodes", "storages"):
            value = getattr(prof, f.name)
            data[f.name] = list(value) if isinstance(value, tuple) else value
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
    """Reads a profile written by ``Profile.save``.

    Raises:
        ProfileFileError: the file is missing, not JSON, of another schema or version,
            or lacks a field; the message names the file and what is wrong.
    """
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ProfileFileError(f"cannot read profile {path}: {exc.strerror or exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProfileFileError(f"{path} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); "
                               "it is not a ckplan profile or it was cut short — profile the model again") from None
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
        storages = tuple(_record(StorageCost, s) for s in data["storages"])
        nodes = tuple(_record(NodeCost, n) for n in data["nodes"])
        run = {f.name: data[f.name] for f in fields(Profile) if f.name not in ("nodes", "storages")
               and (f.name in data or _required(f))}
        run["input_shapes"] = tuple(run["input_shapes"])
        prof = Profile(nodes=nodes, storages=storages, **run)
    except KeyError as exc:
        raise ProfileFileError(f"{source} lacks the field {exc.args[0]!r}; the file is incomplete or was "
                               "edited: profile the model again") from None
    except (TypeError, ValueError, AttributeError) as exc:
        raise ProfileFileError(f"{source} has a malformed record ({exc}); profile the model again") from None
    _check_indices(prof, source)
    return prof


def _required(f) -> bool:
    return f.default is MISSING and f.default_factory is MISSING


def _record(cls, raw: dict) -> Any:
    if not isinstance(raw, dict):
        raise TypeError(f"expected an object, got {type(raw).__name__}")
    known = {f.name for f in fields(cls)}
    missing = [f.name for f in fields(cls) if _required(f) and f.name not in raw]
    if missing:
        raise KeyError(f"{cls.__name__}.{missing[0]}")
    return cls(**{k: tuple(v) if k in _TUPLE_FIELDS else v for k, v in raw.items() if k in known})


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
