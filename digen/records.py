"""Dataclasses that travel as plain data: a task's description (a generation group, a train
spec, an evaluation chunk) goes to a worker inside a msgpack payload, as a dict of numbers,
strings and lists, and is read back into its dataclass there.

A :class:`Record` writes its fields as such a dict (tuples as lists) and reads one back,
converting each value to its field's type (``int``, ``float``, ``str``, ``bool`` (a bool
only), another record, ``X | None``, and tuples, lists and text-keyed dicts of them, nested); a field with a
default may be absent. A payload read from Redis is not trusted, so a value of the wrong kind
fails when the task is read (``int("x")``), not deep inside the task.

:meth:`Record.read_exact` is the reading of a message from Redis or a peer
(:mod:`digen.controlplane.messages`): no conversion at all. A key the record does not have,
a value that is not already of its field's kind (``"3"`` or ``3.5`` for an ``int``, ``True``
for an ``int`` or a ``float``), a text longer than :data:`MAX_TEXT` characters, bytes longer
than :data:`MAX_BYTES` or a list or map of more than :data:`MAX_ITEMS` entries raise
``TypeError``/``ValueError`` naming the field.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, fields
from typing import Any, Self

MAX_TEXT = 1 << 20
"""The longest text a message may carry in one field (characters)."""
MAX_BYTES = 256 << 20
"""The most bytes a message may carry in one field (a grid's PNG cells)."""
MAX_ITEMS = 1 << 20
"""The most entries a message's list or map may have."""


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

    @classmethod
    def read_exact(cls, d: Any) -> Self:
        """``d`` as this record with no conversion (see the module docstring); ``TypeError`` or
        ``ValueError`` naming the field when it is not one."""
        return _read_exact(cls, d, cls.__name__)


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


def _read_exact(cls: type, d: Any, where: str) -> Any:
    if not isinstance(d, dict):
        raise TypeError(f"{where}: expected a map, got {type(d).__name__}")
    known = _exact_readers(cls)
    unknown = [k for k in d if k not in known]
    if unknown:
        shown = ", ".join(repr(k)[:40] for k in unknown[:5])
        raise ValueError(f"{where}: unknown key(s) {shown}")
    missing = [name for name in known if name not in d and name not in _optional(cls)]
    if missing:
        raise ValueError(f"{where}: missing key(s) {', '.join(missing)}")
    return cls(**{name: read(d[name], f"{where}.{name}") for name, read in known.items() if name in d})


_EXACT: dict[type, dict[str, Callable[[Any, str], Any]]] = {}


def _exact_readers(cls: type) -> dict[str, Callable[[Any, str], Any]]:
    found = _EXACT.get(cls)
    if found is None:
        hints = typing.get_type_hints(cls)
        found = _EXACT[cls] = {f.name: _exact(hints[f.name]) for f in fields(cls) if f.init}
    return found


def _kind_error(where: str, want: str, v: Any) -> TypeError:
    return TypeError(f"{where}: expected {want}, got {type(v).__name__}")


def _sized(v: Any, where: str, limit: int, what: str) -> Any:
    if len(v) > limit:
        raise ValueError(f"{where}: {len(v)} {what}, more than the limit of {limit}")
    return v


def _exact(tp: Any) -> Callable[[Any, str], Any]:
    """The exact reader of a field of type ``tp`` (the types :func:`_converter` knows, and bytes)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType) and len(args) == 2 and type(None) in args:
        inner = _exact(next(a for a in args if a is not type(None)))
        return lambda v, w: None if v is None else inner(v, w)
    if isinstance(tp, type) and issubclass(tp, Record):
        return lambda v, w: _read_exact(tp, v, w)
    if tp is bool:
        return lambda v, w: v if isinstance(v, bool) else _raise(_kind_error(w, "true or false", v))
    if tp is int:
        return lambda v, w: (
            v if isinstance(v, int) and not isinstance(v, bool) else _raise(_kind_error(w, "an integer", v))
        )
    if tp is float:
        return lambda v, w: (
            float(v)
            if isinstance(v, int | float) and not isinstance(v, bool)
            else _raise(_kind_error(w, "a number", v))
        )
    if tp is str:
        return lambda v, w: (
            _sized(v, w, MAX_TEXT, "characters") if isinstance(v, str) else _raise(_kind_error(w, "text", v))
        )
    if tp is bytes:
        return lambda v, w: (
            bytes(_sized(v, w, MAX_BYTES, "bytes"))
            if isinstance(v, bytes | bytearray)
            else _raise(_kind_error(w, "bytes", v))
        )
    if origin in (tuple, list) and (origin is list or (len(args) == 2 and args[1] is Ellipsis)):
        item, make = _exact(args[0]), origin

        def seq(v: Any, w: str) -> Any:
            if not isinstance(v, list | tuple):
                raise _kind_error(w, "a list", v)
            _sized(v, w, MAX_ITEMS, "entries")
            return make(item(x, f"{w}[{i}]") for i, x in enumerate(v))

        return seq
    if origin is dict and args[0] is str:
        value = _exact(args[1])

        def mapping(v: Any, w: str) -> dict:
            if not isinstance(v, dict):
                raise _kind_error(w, "a map", v)
            _sized(v, w, MAX_ITEMS, "entries")
            out = {}
            for k, x in v.items():
                if not isinstance(k, str):
                    raise _kind_error(f"{w} key", "text", k)
                out[_sized(k, w, MAX_TEXT, "characters")] = value(x, f"{w}[{k[:40]!r}]")
            return out

        return mapping
    raise TypeError(
        f"a Record field read exactly must be one of the kinds _converter knows or bytes; got {tp!r}"
    )


def _raise(exc: Exception) -> Any:
    raise exc
