"""Bytes that go through Redis: msgpack for plain data, safetensors for tensors. No pickle.

Redis may be shared, so a payload read from it is untrusted: nothing here can execute code
while decoding. Bytes that are not what the reader expects raise
:class:`~digen.errors.PayloadError`; bytes that look like a pickle say so in the message.
"""

from __future__ import annotations

import json
import struct
from typing import TYPE_CHECKING, Any

import msgpack

from digen.errors import PayloadError

if TYPE_CHECKING:
    import torch

_PLAIN = "dict/list/tuple/str/int/float/bool/None/bytes"
_MAX_HEADER = 100_000_000  # safetensors' own limit on the JSON header


def pack(obj: Any) -> bytes:
    """Encode plain data (``dict/list/str/int/float/bool/None/bytes``) with msgpack."""
    try:
        return msgpack.packb(obj, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as err:
        raise PayloadError(f"cannot pack {type(obj).__name__} ({err}); payloads must be {_PLAIN}") from err


def unpack(data: bytes) -> Any:
    """Decode bytes written by :func:`pack`. Anything else raises PayloadError."""
    if looks_like_pickle(data):
        raise PayloadError(f"refusing a pickle payload ({len(data)} bytes); digen never unpickles")
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=_refuse_ext)
    except PayloadError:
        raise
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as err:
        raise PayloadError(f"not a msgpack payload ({len(data)} bytes): {type(err).__name__}: {err}") from err


def pack_tensors(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    """Encode ``{name: tensor}`` (any shapes and dtypes, moved to CPU) and string ``metadata``
    as safetensors bytes."""
    import safetensors.torch

    if metadata is not None and not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise PayloadError("safetensors metadata must map str to str; encode other values with json.dumps")
    flat = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    try:
        return safetensors.torch.save(flat, metadata=metadata)
    except RuntimeError:  # tensors sharing storage (views of one buffer): give each its own
        return safetensors.torch.save({k: v.clone() for k, v in flat.items()}, metadata=metadata)


def unpack_tensors(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Decode :func:`pack_tensors` bytes into ``({name: tensor}, metadata)`` on the CPU."""
    import safetensors.torch

    header = _safetensors_header(data)
    try:
        tensors = safetensors.torch.load(bytes(data))
    except Exception as err:  # safetensors raises its own SafetensorError (not importable stably)
        raise PayloadError(f"invalid safetensors payload ({len(data)} bytes): {err}") from err
    meta = header.get("__metadata__") or {}
    return tensors, {str(k): str(v) for k, v in meta.items()}


def looks_like_pickle(data: bytes) -> bool:
    """True for bytes shaped like a pickle of protocol 2-5: ``\\x80 <proto> ... .`` (PROTO
    opcode first, STOP opcode last). Used to refuse them loudly; nothing is ever unpickled."""
    return len(data) >= 3 and data[0] == 0x80 and 2 <= data[1] <= 5 and data[-1:] == b"."


def _refuse_ext(code: int, data: bytes) -> Any:
    raise PayloadError(f"msgpack extension type {code} is not allowed; payloads must be {_PLAIN}")


def _safetensors_header(data: bytes) -> dict[str, Any]:
    """The JSON header of a safetensors buffer: 8-byte little-endian length, then JSON."""
    if len(data) >= 8:
        (n,) = struct.unpack("<Q", data[:8])
        if 2 <= n <= min(_MAX_HEADER, len(data) - 8):
            try:
                header = json.loads(bytes(data[8 : 8 + n]))
            except (UnicodeDecodeError, json.JSONDecodeError):
                header = None
            if isinstance(header, dict):
                return header
    if looks_like_pickle(data):
        raise PayloadError(f"refusing a pickle payload ({len(data)} bytes); digen never unpickles")
    raise PayloadError(f"not a safetensors payload ({len(data)} bytes): bad header")
