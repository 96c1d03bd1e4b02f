"""Tensors over a byte stream: a JSON header, then each tensor's raw bytes. Never pickle.

A *frame* is ``MAGIC`` (4 bytes), the header's length (8 bytes, little-endian), the header (UTF-8
JSON), then the raw bytes of every tensor the header lists, in its order::

    {"tensors": [{"name": "w", "dtype": "float32", "shape": [4, 8]}, ...], ...other fields}

A peer is untrusted input: the reader accepts only the dtypes of :data:`DTYPES`, checks every
shape, bounds the header (:data:`MAX_HEADER`) and the payload (``max_bytes``), and reads the
bytes straight into tensors it allocated itself (no copy, nothing executed). A tensor goes out
as a view of its own memory (no copy either), so a 1.6 GiB gradient costs one pass over the
socket on each side.
"""

from __future__ import annotations

import json
import math
import socket
import struct
from typing import Any

import torch

from digen.errors import PayloadError

MAGIC = b"DGN1"
MAX_HEADER = 16 * 2**20
"""Largest header a reader accepts (a LoRA of a 12B model lists about 10k tensors: ~1 MiB)."""

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype named ``name`` (one of :data:`DTYPES`), else :class:`PayloadError`."""
    if name not in DTYPES:
        raise PayloadError(f"dtype {name!r} is not one of {sorted(DTYPES)}")
    return DTYPES[name]


def tensor_nbytes(spec: dict[str, Any]) -> int:
    return math.prod(spec["shape"]) * dtype_of(spec["dtype"]).itemsize


def describe(tensors: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    """The header entries of ``tensors`` (in their dict order)."""
    return [
        {"name": name, "dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape)} for name, t in tensors.items()
    ]


def _raw(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def send_frame(
    sock: socket.socket, header: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None
) -> int:
    """Write one frame: ``header`` plus ``tensors`` (moved to the CPU and made contiguous one
    at a time, as they are sent). Returns the payload bytes sent."""
    tensors = tensors or {}
    head = dict(header)
    head["tensors"] = describe(tensors)
    body = json.dumps(head).encode()
    sock.sendall(MAGIC + struct.pack("<Q", len(body)) + body)
    sent = 0
    for t in tensors.values():
        data = _raw(t.detach().to("cpu").contiguous())
        sock.sendall(data)
        sent += len(data)
    return sent


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError(f"the peer closed the connection after {got} of {len(view)} bytes")
        got += n


def recv_header(sock: socket.socket) -> dict[str, Any]:
    """Read a frame's header (the tensors' bytes follow: :func:`recv_tensors`)."""
    pre = bytearray(12)
    _recv_exact(sock, memoryview(pre))
    if bytes(pre[:4]) != MAGIC:
        raise PayloadError(f"not a digen data-plane frame (starts with {bytes(pre[:4])!r})")
    (n,) = struct.unpack("<Q", pre[4:])
    if n > MAX_HEADER:
        raise PayloadError(f"frame header of {n} bytes is over the {MAX_HEADER}-byte limit")
    body = bytearray(n)
    _recv_exact(sock, memoryview(body))
    try:
        header = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PayloadError(f"frame header is not JSON ({exc})") from None
    if not isinstance(header, dict) or not isinstance(header.get("tensors", []), list):
        raise PayloadError("frame header must be a JSON object with a 'tensors' list")
    for spec in header.get("tensors", []):
        _check_spec(spec)
    return header


def _check_spec(spec: Any) -> None:
    ok = (
        isinstance(spec, dict)
        and isinstance(spec.get("name"), str)
        and isinstance(spec.get("shape"), list)
        and all(isinstance(d, int) and d >= 0 for d in spec["shape"])
    )
    if not ok:
        raise PayloadError(f"bad tensor entry in a frame header: {str(spec)[:200]}")
    dtype_of(spec.get("dtype"))


def recv_tensors(
    sock: socket.socket, header: dict[str, Any], *, max_bytes: int | None = None
) -> dict[str, torch.Tensor]:
    """Read the tensors ``header`` announces, each into a fresh CPU tensor."""
    specs = header.get("tensors", [])
    total = sum(tensor_nbytes(s) for s in specs)
    if max_bytes is not None and total > max_bytes:
        raise PayloadError(f"frame announces {total} bytes, over the {max_bytes}-byte limit")
    out: dict[str, torch.Tensor] = {}
    for spec in specs:
        t = torch.empty(spec["shape"], dtype=dtype_of(spec["dtype"]))
        _recv_exact(sock, _raw(t))
        out[spec["name"]] = t
    return out
