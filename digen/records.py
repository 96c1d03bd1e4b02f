"""Dataclasses that travel as plain data: a task's description (a generation group, a train
spec, an evaluation chunk) goes to a worker inside a msgpack payload, as a dict of numbers,
strings and lists, and is read back into its dataclass there.

A :class:`Record` writes its fields as such a dict (tuples as lists) and reads one back,
converting each value to its field's type (``int``, ``float``, ``str``, ``bool`` (a bool
only), another record, ``X | None``, and tuples, lists and text-keyed dicts of them, nested); a field with a
default may be absent. A payload read from Redis is not trusted, so a value of the wrong kind
fails when the task is read (``int("x")``), not deep inside the task.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, fields
from typing import Any, Self


class Record:
    """A dataclass's JSON-like form (mix it into a ``@dataclass``)."""

    def to_json(self) -> dict:
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}  # type: ignore[arg-type]

    @classmethod
    def from_json(cls, d: dict) -> Self:
        return cls(
            **{
                name: convert(d[name])
                for name, convert in _converters(cls)
                if name in d or name not in _optional(cls)
            }
        )


def _plain(value: Any) -> Any:
    if isinstance(value, Record):
        return value.to_json()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return [_plain(v) for v in value] if isinstance(value, tuple | list) else value


def _optional(cls: type) -> set[str]:
    """The fields of ``cls`` that have a default (may be absent from a dict)."""
    return {f.name for f in fields(cls) if f.default is not MISSING or f.default_factory is not MISSING}


def _sequence(v: Any) -> list | tuple:
    """A list field's value: a list (a string is not a list of its characters)."""
    if not isinstance(v, list | tuple):
        raise TypeError(f"expected a list, got {type(v).__name__}")
    return v


def _mapping(v: Any) -> dict:
    if not isinstance(v, dict):
        raise TypeError(f"expected a map, got {type(v).__name__}")
    return v


def _str_key(k: Any) -> str:
    if not isinstance(k, str):
        raise TypeError(f"expected a text key, got {type(k).__name__}")
    return k


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise TypeError(f"expected true or false, got {type(v).__name__}")
    return v


_CONVERTERS: dict[type, list[tuple[str, Callable[[Any], Any]]]] = {}


def _converters(cls: type) -> list[tuple[str, Callable[[Any], Any]]]:
    """Each init field's name and the function that makes a plain value of its type (once a class)."""
    found = _CONVERTERS.get(cls)
    if found is None:
        hints = typing.get_type_hints(cls)
        found = _CONVERTERS[cls] = [(f.name, _converter(hints[f.name])) for f in fields(cls) if f.init]
    return found


def _converter(tp: Any) -> Callable[[Any], Any]:
    """``int`` -> int(); ``tuple[int, ...]`` -> a tuple of int(); ``list[list[int]]`` -> nested lists."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType) and len(args) == 2 and type(None) in args:
        inner = _converter(next(a for a in args if a is not type(None)))
        return lambda v: None if v is None else inner(v)
    if isinstance(tp, type) and issubclass(tp, Record):
        return tp.from_json
    if tp is bool:
        return _bool
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        item = _converter(args[0])
        return lambda v: tuple(item(x) for x in _sequence(v))
    if origin is list:
        item = _converter(args[0])
        return lambda v: [item(x) for x in _sequence(v)]
    if origin is dict and args[0] is str:
        value = _converter(args[1])
        return lambda v: {_str_key(k): value(x) for k, x in _mapping(v).items()}
    if tp in (int, float, str):
        return tp
    raise TypeError(
        "a Record field must be int, float, str, bool, a Record, X | None, or a list, tuple or "
        f"str-keyed dict of them; got {tp!r}"
    )
