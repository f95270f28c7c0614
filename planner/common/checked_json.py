"""Reading JSON files ckplan wrote, without trusting them: parse a file into plain values, and check a
record built from those values against its dataclass annotations, so that a loader returns well-typed
records or refuses the file naming the field. Plans and profiles are plain JSON; nothing here runs
code from the file (no pickle, no eval). Torch-free.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import math
import reprlib
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

INT_LIMIT = 2**63
"""Integers in a file must fit an int64 (numpy, CP-SAT and torch hold every count ckplan stores as one)."""
UNIT_LIMITS = {"bytes": 2**48, "_ms": 1e9, "_s": 1e6, "_us": 1e6, "_ops": 1e6}
"""Fields named in a unit (the project's style: units live in names) hold a measured amount: never negative,
and in a profile at most this, far past any real step (256 TiB, 11 days, 1 s of overhead per op, a
million ATen ops per node), so that the planner's int64 sums and products of them cannot overflow."""


def read_json(path: str | Path) -> Any:
    """The JSON value in the file at ``path``.

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not UTF-8 JSON (binary data such as a pickle, broken or cut-short JSON, a number
            too long to convert), or it nests too deeply to parse; the message says which.
    """
    raw = Path(path).read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("it is binary data, not JSON text (a pickle or another format)") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"it is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    except RecursionError:
        raise ValueError("it nests JSON too deeply to be a file ckplan wrote") from None
    except ValueError as exc:  # e.g. an integer of more digits than Python converts
        raise ValueError(f"it is not JSON ckplan can read ({exc})") from None


def record_from_json(cls: type, raw: Any, where: str, *, convert: dict[str, Callable[[Any], Any]] | None = None) -> Any:
    """The dataclass ``cls`` a JSON object describes: its known keys (keys this version does not know are
    ignored), JSON lists as tuples, and the fields named in ``convert`` through their converter (an enum
    from its value, a nested record). The field types are checked afterwards, by ``check_record``.

    Raises:
        TypeError: ``raw`` is not an object. KeyError: a required field is missing (``Class.field``).
        ValueError: a converter refused its value (an unknown enum value).
    """
    if not isinstance(raw, dict):
        raise TypeError(f"{where} is {type(raw).__name__}, expected an object")
    missing = [f.name for f in dataclasses.fields(cls) if f.init and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING and f.name not in raw]
    if missing:  # the field's own name at the top of a file, its path inside it
        raise KeyError(f"{where}.{missing[0]}" if "." in where or "[" in where else missing[0])
    known = {f.name for f in dataclasses.fields(cls) if f.init}
    convert = convert or {}
    return cls(**{k: convert[k](v) if k in convert and v is not None else as_tuple(v)
                  for k, v in raw.items() if k in known})


def as_tuple(value: Any) -> Any:
    """A JSON list as the tuple a record holds; anything else as it is, for ``check_record`` to refuse (a
    string is no tuple of names, though ``tuple()`` would make one)."""
    return tuple(value) if isinstance(value, list) else value


def as_list(value: Any, where: str) -> list:
    """``value`` if it is a JSON list, else a ``TypeError`` naming ``where``."""
    if not isinstance(value, list):
        raise TypeError(f"{where} is {reprlib.repr(value)}, expected a list")
    return value


def check_record(record: Any, *, where: str, limits: Mapping[str, float] = UNIT_LIMITS,
                 signed: tuple[str, ...] = ()) -> None:
    """Raises ``TypeError`` naming ``where.field`` unless every field of the dataclass ``record`` (nested
    records, tuples and dicts included) holds its annotated type: ints (not bools) that fit an int64,
    finite floats (ints accepted), and in a field named in a unit an amount in ``[0, limits[unit]]``
    (``[-limit, limit]`` for the field names in ``signed``)."""

    def check(value: Any, hint: Any, path: str, bounds: tuple[float, float] | None) -> None:
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if origin in (typing.Union, types.UnionType):
            for option in args:
                try:
                    return check(value, option, path, bounds)
                except TypeError:
                    continue
            raise TypeError(f"{path} is {reprlib.repr(value)}, expected {_name(hint)}")
        if origin is tuple:
            each = args[-1:] == (...,)
            if not isinstance(value, tuple) or (not each and len(value) != len(args)):
                raise TypeError(f"{path} is {reprlib.repr(value)}, expected {_name(hint)}")
            for i, item in enumerate(value):
                check(item, args[0] if each else args[i], f"{path}[{i}]", bounds)
            return None
        if origin is dict:
            if not isinstance(value, dict):
                raise TypeError(f"{path} is {reprlib.repr(value)}, expected {_name(hint)}")
            for key, item in value.items():
                check(key, args[0], f"{path} key", None)
                check(item, args[1], f"{path}[{key!r}]", bounds)
            return None
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            if not isinstance(value, hint):
                raise TypeError(f"{path} is {reprlib.repr(value)}, expected an object ({hint.__name__})")
            return fields_of(value, path)
        if not _is(value, hint):
            raise TypeError(f"{path} is {reprlib.repr(value)}, expected {_name(hint)}")
        if bounds is not None and hint in (int, float) and not bounds[0] <= value <= bounds[1]:
            raise TypeError(f"{path} is {reprlib.repr(value)}, expected an amount in [{bounds[0]:g}, {bounds[1]:g}]")
        return None

    def fields_of(value: Any, path: str) -> None:
        record_type: type = type(value)  # annotated: mypy does not take type[Any] for Hashable
        hints = _hints(record_type)
        for f in dataclasses.fields(value):
            limit = next((v for unit, v in limits.items() if f.name.endswith(unit)), None)
            bounds = None if limit is None else (-limit if f.name in signed else 0, limit)
            check(getattr(value, f.name), hints[f.name], f"{path}.{f.name}", bounds)

    fields_of(record, where)


_hints = functools.cache(typing.get_type_hints)


def _is(value: Any, hint: Any) -> bool:
    if hint is typing.Any:
        return True
    if hint is type(None):
        return value is None
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool) and -INT_LIMIT <= value < INT_LIMIT
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return isinstance(value, hint)  # bool, str, enums and other classes


def _name(hint: Any) -> str:
    """What a value of ``hint`` looks like in JSON."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_name(a) for a in args)
    if origin is tuple:
        return f"a list (each {_name(args[0])})" if args[-1:] == (...,) else f"a list of {len(args)} items"
    if origin is dict:
        return f"an object (each value {_name(args[1])})"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return f"one of {', '.join(repr(m.value) for m in hint)}"
    return {int: "an integer (int64)", float: "a finite number", str: "a string", bool: "true or false",
            type(None): "null"}.get(hint, getattr(hint, "__name__", str(hint)))
