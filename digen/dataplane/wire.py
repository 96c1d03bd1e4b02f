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
import time
from collections.abc import Collection
from contextlib import nullcontext
from typing import Any

import torch

from digen.dataplane.digest import ALGORITHM, Receiver, raw_bytes
from digen.errors import PayloadError

MAGIC = b"DGN1"
PREFIX = 12
"""A frame's first bytes: ``MAGIC`` and the header's length."""
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


NAME_CUT = 120
"""At most this many characters of a peer's name appear in a message or a log line."""


def cut(text: object, n: int = NAME_CUT) -> str:
    """``text`` shortened to ``n`` characters for a message (a peer chose it: it may be huge)."""
    s = str(text)
    return s if len(s) <= n else f"{s[:n]}...({len(s)} chars)"


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


def cast_to(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``t`` as it travels when the receiver asked for ``dtype``: floating tensors cast,
    others as they are."""
    return t.to(dtype) if dtype is not None and t.is_floating_point() else t


def _timeout(sock: socket.socket, deadline: float | None) -> None:
    """Give the next socket call what is left until ``deadline`` (monotonic; None: leave it)."""
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request's deadline passed")
        sock.settimeout(left)


def send_frame(
    sock: socket.socket,
    header: dict[str, Any],
    tensors: dict[str, torch.Tensor] | None = None,
    *,
    cast: torch.dtype | None = None,
    deadline: float | None = None,
) -> int:
    """Write one frame: ``header`` plus ``tensors`` (each moved to the CPU, made contiguous and,
    for floating tensors when ``cast`` is given, cast, one at a time as it is sent: never a copy
    of the whole frame). ``deadline`` (monotonic): the whole frame must be out by then, else
    :class:`TimeoutError`. Returns the payload bytes sent."""
    tensors = tensors or {}
    head = dict(header)
    head["tensors"] = [
        {"name": n, "dtype": DTYPE_NAMES[cast_to_dtype(t, cast)], "shape": list(t.shape)}
        for n, t in tensors.items()
    ]
    _timeout(sock, deadline)
    sock.sendall(encode_header(head))
    sent = 0
    for t in tensors.values():
        data = raw_bytes(cast_to(t.detach(), cast).to("cpu").contiguous())
        _timeout(sock, deadline)
        sock.sendall(data)
        sent += len(data)
    return sent


def encode_header(header: dict[str, Any]) -> bytes:
    """The bytes of a frame whose header is ``header`` (its ``tensors`` list, empty when
    absent, says what bytes follow)."""
    body = json.dumps(header if "tensors" in header else {**header, "tensors": []}).encode()
    return MAGIC + struct.pack("<Q", len(body)) + body


def header_length(prefix: bytes, max_header: int = MAX_HEADER) -> int:
    """The header length a frame's first :data:`PREFIX` bytes announce, once they say it is a
    frame and the length is within ``max_header`` (else :class:`PayloadError`)."""
    if bytes(prefix[:4]) != MAGIC:
        raise PayloadError(f"not a digen data-plane frame (starts with {bytes(prefix[:4])!r})")
    (n,) = struct.unpack("<Q", prefix[4:PREFIX])
    if n > max_header:
        raise PayloadError(f"frame header of {n} bytes is over the {max_header}-byte limit")
    return n


def decode_header(body: bytes | bytearray) -> dict[str, Any]:
    """A frame's header from its bytes, checked (:class:`PayloadError`)."""
    try:
        header = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PayloadError(f"frame header is not JSON ({exc})") from None
    if not isinstance(header, dict) or not isinstance(header.get("tensors", []), list):
        raise PayloadError("frame header must be a JSON object with a 'tensors' list")
    for spec in header.get("tensors", []):
        _check_spec(spec)
    return header


def cast_to_dtype(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and t.is_floating_point() else t.dtype


def on_host(tensors: dict[str, torch.Tensor], cast: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """``tensors`` in host memory (floating ones cast to ``cast`` when given): those already
    there as they are (no copy unless the cast makes one: for tensors that nothing rewrites,
    such as a task's gradient), the others copied (:func:`host_copy`)."""
    on_device = {k: t for k, t in tensors.items() if t.device.type != "cpu"}
    copied = host_copy(on_device, cast) if on_device else {}
    return {k: copied[k] if k in copied else cast_to(t, cast) for k, t in tensors.items()}


def copy_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The stream a host copy from ``device`` runs on: for a CUDA device a side stream (from
    torch's pool) that first waits for everything the device's current stream has queued (the
    optimizer step that wrote the values), so the copy reads the values as of the call and
    never queues behind, or in front of, the training thread's later kernels on the default
    stream; None for the host (no stream: nothing of CUDA is touched, not even initialised)."""
    if device.type != "cuda":
        return None
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    return side


def host_copy(tensors: dict[str, torch.Tensor], cast: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """A snapshot of ``tensors`` to serve: each one's values now, in host memory of its own
    (contiguous; floating tensors cast to ``cast`` when given), so that a step that later
    rewrites the source (a trainer's parameters) cannot change what a blob serves, and a frame
    sends it with no further copy. A blob is immutable once put
    (:class:`~digen.dataplane.blobs.BlobStore`): serve this, never a view of live memory.

    From CUDA tensors (one device: a worker's) the copy lands in pinned memory, made on a side
    stream (:func:`copy_stream`; the cast runs there too, one tensor at a time: never a cast
    copy of the whole version on the device), asynchronously,
    and that stream is synchronized before this returns: the bytes are final then, and the
    sources, which the caller holds until then, were not freed while the stream read them.
    Host tensors are copied on the host, unpinned (pinning needs CUDA and only speeds a copy
    from a device)."""
    devices = {t.device for t in tensors.values() if t.device.type != "cpu"}
    if len(devices) > 1:
        raise ValueError(f"a host copy reads one device's tensors, got {sorted(map(str, devices))}")
    side = copy_stream(next(iter(devices))) if devices else None
    out: dict[str, torch.Tensor] = {}
    with torch.cuda.stream(side) if side is not None else nullcontext():
        for name, t in tensors.items():
            src = t.detach()
            pinned = src.device.type == "cuda"
            buf = torch.empty(src.shape, dtype=cast_to_dtype(src, cast), device="cpu", pin_memory=pinned)
            out[name] = buf.copy_(cast_to(src, cast), non_blocking=pinned)
    if side is not None:
        side.synchronize()
    return out


def _recv_exact(
    sock: socket.socket, view: memoryview, deadline: float | None = None, receiver: Receiver | None = None
) -> None:
    got = 0
    while got < len(view):
        _timeout(sock, deadline)
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError(f"the peer closed the connection after {got} of {len(view)} bytes")
        got += n
        if receiver is not None:
            receiver.landed(got)


def recv_header(
    sock: socket.socket,
    *,
    max_header: int = MAX_HEADER,
    idle_s: float | None = None,
    header_s: float | None = None,
    deadline: float | None = None,
) -> dict[str, Any]:
    """Read a frame's header (the tensors' bytes follow: :func:`recv_tensors`). A server reads
    requests with ``idle_s``: how long to wait for a request's first byte, and ``header_s``:
    how long the whole header may take from there (a peer that trickles bytes is cut, however
    often it sends one); ``deadline`` (monotonic): the whole header must be in by then,
    whatever the other two allow. :class:`TimeoutError` when any passes."""
    pre = bytearray(PREFIX)
    view = memoryview(pre)
    if idle_s is not None:
        if deadline is not None:
            idle_s = min(idle_s, deadline - time.monotonic())
            if idle_s <= 0:
                raise TimeoutError("the header's deadline passed")
        sock.settimeout(idle_s)
        n = sock.recv_into(view[:1])
        if n == 0:
            raise ConnectionError("the peer closed the connection")
        view = view[1:]
    end = None if header_s is None else time.monotonic() + header_s
    deadline = end if deadline is None else deadline if end is None else min(end, deadline)
    _recv_exact(sock, view, deadline)
    body = bytearray(header_length(pre, max_header))
    _recv_exact(sock, memoryview(body), deadline)
    return decode_header(body)


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
    sock: socket.socket,
    header: dict[str, Any],
    *,
    max_bytes: int | None = None,
    hashed: Collection[str] = (),
    digests: dict[str, str] | None = None,
    algorithm: str = ALGORITHM,
) -> dict[str, torch.Tensor]:
    """Read the tensors ``header`` announces, each into a fresh CPU tensor. The digest
    (:mod:`digen.dataplane.digest`, with ``algorithm``) of each tensor named in ``hashed`` goes
    into ``digests``, computed piece by piece while the rest is still arriving."""
    specs = header.get("tensors", [])
    total = sum(tensor_nbytes(s) for s in specs)
    if max_bytes is not None and total > max_bytes:
        raise PayloadError(f"frame announces {total} bytes, over the {max_bytes}-byte limit")
    out: dict[str, torch.Tensor] = {}
    pending: dict[str, Receiver] = {}
    for spec in specs:
        t = torch.empty(spec["shape"], dtype=dtype_of(spec["dtype"]))
        data = raw_bytes(t)
        receiver = Receiver(data, algorithm) if spec["name"] in hashed else None
        _recv_exact(sock, data, receiver=receiver)
        if receiver is not None:
            pending[spec["name"]] = receiver
        out[spec["name"]] = t
    if digests is not None:
        digests.update({n: r.digest() for n, r in pending.items()})
    return out
