"""Worker-to-worker tensors: each process serves the blobs it made; peers fetch them directly.

A *blob* is a named set of tensors with string metadata: a generated group's trajectories, a
train task's gradient, a policy version's weights. The process that made it keeps it in its
:class:`BlobStore` and serves it with a :class:`BlobServer` (one TCP listener per process,
started on first use: :func:`local_server`); Redis only says *where* a blob lives (its
server's address and name, a few dozen bytes). A consumer :func:`fetch`\\ es what it needs,
all of a blob or some of its tensors, optionally cast to the dtype it computes in, one frame
per request over one connection (:mod:`digen.dataplane.wire`; no pickle anywhere).

When the producer is gone (its process died, or it dropped the blob) a fetch raises
:class:`BlobLost`: the work that made the blob runs again (the controller's business).

With ``security`` certificates (the same files as Dask's TLS), the listener and every fetch
use mutual TLS: a peer without a certificate the CA signed is refused.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from digen.dataplane.wire import DTYPE_NAMES, dtype_of, recv_header, recv_tensors, send_frame, tensor_nbytes
from digen.errors import DigenError, PayloadError

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0
IO_TIMEOUT_S = 300.0
"""A fetch whose peer sends nothing for this long fails (a hung or partitioned peer)."""


class BlobLost(DigenError):
    """A blob that cannot be fetched: its server is unreachable or no longer has it."""


@dataclass
class Blob:
    tensors: dict[str, torch.Tensor]
    meta: dict[str, str] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class BlobStore:
    """The blobs this process serves, by name. Thread-safe; a blob is immutable once put
    (a new version of something is a new name), so readers need no lock while sending."""

    def __init__(self) -> None:
        self._blobs: dict[str, Blob] = {}
        self._lock = threading.Lock()

    def put(self, name: str, tensors: dict[str, torch.Tensor], meta: dict[str, str] | None = None) -> Blob:
        blob = Blob(dict(tensors), dict(meta or {}))
        with self._lock:
            self._blobs[name] = blob
        return blob

    def get(self, name: str) -> Blob | None:
        with self._lock:
            return self._blobs.get(name)

    def drop(self, *names: str) -> None:
        with self._lock:
            for n in names:
                self._blobs.pop(n, None)

    def drop_where(self, keep) -> list[str]:
        """Drop every blob whose name ``keep(name)`` rejects; returns the dropped names."""
        with self._lock:
            gone = [n for n in self._blobs if not keep(n)]
            for n in gone:
                del self._blobs[n]
        return gone

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._blobs)

    def nbytes(self) -> int:
        with self._lock:
            return sum(b.nbytes for b in self._blobs.values())


# --- TLS -------------------------------------------------------------------------------
def tls_contexts(ca_file: str, cert_file: str, key_file: str) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(server, client) contexts for mutual TLS with the cluster's certificates. Peers are
    reached by address, so host names are not checked; the CA's signature is."""
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=ca_file)
    server.load_cert_chain(cert_file, key_file)
    server.verify_mode = ssl.CERT_REQUIRED
    client = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file)
    client.load_cert_chain(cert_file, key_file)
    client.check_hostname = False
    client.verify_mode = ssl.CERT_REQUIRED
    return server, client


# --- server ----------------------------------------------------------------------------
class BlobServer:
    """Serves a :class:`BlobStore` on a TCP port (a thread per connection).

    Requests (frame headers, no tensors)::

        {"op": "get", "blob": NAME, "names": [..] | null, "exclude": [..], "dtype": "bfloat16" | null}
            -> {"ok": true, "meta": {...}} + the tensors (``names``, else all but ``exclude``;
               cast to dtype when given)
        {"op": "describe", "blob": NAME} -> {"ok": true, "meta": {...}, "specs": [...]}
        anything else, or a missing blob -> {"ok": false, "error": "missing" | "bad", "message": ...}
    """

    def __init__(
        self,
        store: BlobStore,
        host: str = "127.0.0.1",
        port: int = 0,
        ssl_context: ssl.SSLContext | None = None,
        advertise: str | None = None,
    ):
        self.store = store
        self.ssl_context = ssl_context
        self.sock = socket.create_server((host, port), reuse_port=False)
        self.sock.listen(64)
        bound_host, bound_port = self.sock.getsockname()[:2]
        self.address = f"{advertise or bound_host}:{bound_port}"
        self.bytes_sent = 0
        """Tensor bytes served (counted before they go out, so a client that has them sees them counted)."""
        self._count = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="digen-blob-server", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
        with contextlib.suppress(OSError):
            self.sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="digen-blob-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            if self.ssl_context is not None:
                conn = self.ssl_context.wrap_socket(conn, server_side=True)
            conn.settimeout(IO_TIMEOUT_S)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while True:
                try:
                    req = recv_header(conn)
                except ConnectionError:
                    return  # the client is done
                self._answer(conn, req)
        except (OSError, ssl.SSLError, PayloadError) as exc:
            log.debug("blob server: connection ended (%s)", exc)
        finally:
            with contextlib.suppress(OSError):
                conn.close()

    def _answer(self, conn: socket.socket, req: dict[str, Any]) -> None:
        op, name = req.get("op"), req.get("blob")
        blob = self.store.get(name) if isinstance(name, str) else None
        if op not in ("get", "describe") or not isinstance(name, str):
            send_frame(conn, {"ok": False, "error": "bad", "message": f"unknown request {str(req)[:100]}"})
            return
        if blob is None:
            send_frame(conn, {"ok": False, "error": "missing", "message": f"no blob {name}"})
            return
        if op == "describe":
            specs = [
                {"name": n, "dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape)}
                for n, t in blob.tensors.items()
            ]
            send_frame(conn, {"ok": True, "meta": blob.meta, "specs": specs})
            return
        names = req.get("names")
        skip = set(req.get("exclude") or [])
        wanted = [n for n in blob.tensors if n not in skip] if names is None else names
        missing = [n for n in wanted if n not in blob.tensors]
        if missing:
            send_frame(
                conn, {"ok": False, "error": "missing", "message": f"{name} has no tensor {missing[0]}"}
            )
            return
        dtype = dtype_of(req["dtype"]) if req.get("dtype") else None
        out = {}
        for n in wanted:
            t = blob.tensors[n]
            out[n] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
        with self._count:
            self.bytes_sent += sum(t.numel() * t.element_size() for t in out.values())
        send_frame(conn, {"ok": True, "meta": blob.meta}, out)


# --- client ----------------------------------------------------------------------------
_CLIENT_SSL: ssl.SSLContext | None = None


@contextlib.contextmanager
def connection(address: str, ssl_context: ssl.SSLContext | None = None) -> Iterator[socket.socket]:
    """A connection to the blob server at ``host:port`` (:class:`BlobLost` when it cannot be reached)."""
    host, _, port = address.rpartition(":")
    ctx = ssl_context if ssl_context is not None else _CLIENT_SSL
    try:
        sock = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S)
    except (OSError, ValueError) as exc:
        raise BlobLost(f"blob server {address} unreachable ({exc})") from None
    try:
        if ctx is not None:
            sock = ctx.wrap_socket(sock)
        sock.settimeout(IO_TIMEOUT_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        yield sock
    finally:
        with contextlib.suppress(OSError):
            sock.close()


def _request(sock: socket.socket, address: str, req: dict[str, Any]) -> dict[str, Any]:
    try:
        send_frame(sock, req)
        head = recv_header(sock)
    except (OSError, ssl.SSLError) as exc:
        raise BlobLost(f"blob {req.get('blob')} at {address}: connection failed ({exc})") from None
    if not head.get("ok"):
        raise BlobLost(f"blob {req.get('blob')} at {address}: {head.get('message', 'refused')}")
    return head


def fetch(
    address: str,
    name: str,
    *,
    names: list[str] | None = None,
    exclude: tuple[str, ...] | list[str] = (),
    dtype: torch.dtype | None = None,
    sock: socket.socket | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Blob ``name`` from the server at ``address`` (only ``names`` of its tensors when
    given, else all but ``exclude``; floating tensors cast to ``dtype`` by the server when
    given): (tensors, meta). ``sock``: an open :func:`connection` to reuse."""
    if sock is None:
        with connection(address) as s:
            return fetch(address, name, names=names, exclude=exclude, dtype=dtype, sock=s)
    req = {
        "op": "get",
        "blob": name,
        "names": names,
        "exclude": list(exclude),
        "dtype": DTYPE_NAMES[dtype] if dtype is not None else None,
    }
    head = _request(sock, address, req)
    try:
        tensors = recv_tensors(sock, head)
    except (OSError, ssl.SSLError) as exc:
        raise BlobLost(f"blob {name} at {address}: connection failed mid-transfer ({exc})") from None
    return tensors, {str(k): str(v) for k, v in (head.get("meta") or {}).items()}


def describe(address: str, name: str) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """(tensor specs ``{name, dtype, shape}``, meta) of blob ``name``, no tensor bytes."""
    with connection(address) as s:
        head = _request(s, address, {"op": "describe", "blob": name})
    return list(head.get("specs", [])), dict(head.get("meta") or {})


def buckets(
    specs: list[dict[str, Any]], bucket_bytes: int, dtype: torch.dtype | None = None
) -> list[list[str]]:
    """Tensor names in consecutive groups of about ``bucket_bytes`` each (a tensor larger than
    a bucket is a bucket of its own), sized as they travel (cast to ``dtype`` when given)."""
    out: list[list[str]] = [[]]
    size = 0
    for s in specs:
        n = tensor_nbytes(s)
        if dtype is not None and dtype_of(s["dtype"]).is_floating_point:
            n = n // dtype_of(s["dtype"]).itemsize * dtype.itemsize
        if out[-1] and size + n > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(s["name"])
        size += n
    return [b for b in out if b]


# --- this process's server ---------------------------------------------------------------
_LOCAL: dict[str, Any] = {}
_LOCAL_LOCK = threading.Lock()


def local_store() -> BlobStore:
    """This process's blob store (created on first use)."""
    with _LOCAL_LOCK:
        if "store" not in _LOCAL:
            _LOCAL["store"] = BlobStore()
        return _LOCAL["store"]


def local_server(host: str = "127.0.0.1", tls: tuple[str, str, str] | None = None) -> BlobServer:
    """This process's blob server over :func:`local_store`, started on first use, listening on
    ``host`` (the address peers reach this process at: a Dask worker's host). ``tls``: (CA,
    certificate, key) files: mutual TLS for the server and every fetch from this process."""
    global _CLIENT_SSL
    store = local_store()
    with _LOCAL_LOCK:
        server = _LOCAL.get("server")
        if server is None:
            server_ctx = None
            if tls is not None:
                server_ctx, _CLIENT_SSL = tls_contexts(*tls)
            server = _LOCAL["server"] = BlobServer(store, host=host, ssl_context=server_ctx)
            log.info("blob server of process listening at %s", server.address)
        return server
