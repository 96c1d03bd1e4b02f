"""Worker-to-worker tensors: each process serves the blobs it made; peers fetch them directly.

A *blob* is a named set of tensors with string metadata: a generated group's trajectories, a
train task's gradient, a policy version's weights. The process that made it keeps it in its
:class:`BlobStore` and serves it with a :class:`BlobServer` (one TCP listener per process,
started on first use: :func:`local_server`); Redis only says *where* a blob lives (its
server's address, name and digest, a few dozen bytes). A consumer :func:`fetch`\\ es what it
needs, all of a blob or some of its tensors, optionally cast to the dtype it computes in, one
frame per request over one connection (:mod:`digen.dataplane.wire`; no pickle anywhere).

When the producer is gone (its process died, or it dropped the blob) a fetch raises
:class:`BlobLost`: the work that made the blob runs again (the controller's business).

Who may read (:mod:`digen.dataplane.auth`): every request carries an HMAC with the job's key;
a request without it, or with a wrong one, gets a refusal frame and no data. Every answer
carries the blob's *manifest* (its identity: job, name, version, producer incarnation; and
each tensor's name, dtype, shape and digest: :mod:`digen.dataplane.digest`) and a proof that
the server holds the key. The consumer checks the proof, the identity, the names, shapes and
dtypes it gets against the manifest, each tensor's bytes against its digest, and the manifest
against what the control plane published (:class:`Expect`); any mismatch is a
:class:`BlobMismatch`, a :class:`BlobLost` (the work runs again), with one warning naming the
producer. A floating tensor the server casts on the way (``dtype``) has new bytes the
producer never hashed: its name, shape and the manifest are checked, its bytes only by the
transport; the trainers keep each version in the rollout's dtype, so a rollout's fetch casts
nothing.

A server that survives abuse. A new connection must *authenticate* within ``auth_s``
(default :data:`AUTH_S`): finish its TLS handshake (within ``handshake_s``) and send a first
request signed with a job's key; one that does not is dropped (counted ``auth_timeout``). At
most ``max_pending`` connections wait to authenticate at once; one more drops the oldest of
them (``evicted``), so a flood of connections that never authenticate cannot keep a peer of
the job out: a real peer sends its first request within a round trip of the hello, and would
have to be out-waited by ``max_pending`` new connections in that time. Until it has
authenticated a connection costs no thread: one selector loop, the :class:`~digen.dataplane.gate.Gate`,
accepts, does the TLS handshake without blocking, sends the hello and reads and checks the
first request, under the same deadlines and size caps (why a loop, and its bounds: that
module's docstring); only an authenticated connection gets a thread, at most ``max_conns``. The
caps on connections served count authenticated peers by *identity*, the requester name its
MAC covers, not by address (every peer on loopback is 127.0.0.1): at most ``max_conns`` at
once, ``max_per_peer`` of one identity; one over the cap gets a ``busy`` answer to its first
request (after the TLS handshake, so a TLS peer reads it) and is closed. An authenticated
connection idle for ``idle_s`` is closed, a request header must arrive whole within
``header_s`` of its first byte and be under ``max_request`` bytes, a whole answer must be out
within ``request_s``; casts are made one tensor at a time as they are sent; a failing ``accept``
(out of file descriptors: ``EMFILE``; ``ECONNABORTED``) backs off and retries, logged once per
error kind; a malformed request gets an error frame and a debug log line, never a traceback;
names in messages are cut (:func:`cut`).

With ``security`` certificates (the same files as Dask's TLS), the listener and every fetch
also use mutual TLS: a peer without a certificate the CA signed is refused before any frame.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from digen.core.blobnames import job_of
from digen.dataplane.auth import (
    Keyring,
    incarnation,
    keyring,
    new_nonce,
    proof_mac,
    request_mac,
    same,
)
from digen.dataplane.digest import ALGORITHM, ALGORITHMS, manifest_digest, tensor_digests
from digen.dataplane.gate import LINGER_BYTES, LINGER_S, Gate, Waiting
from digen.dataplane.wire import (
    DTYPE_NAMES,
    DTYPES,
    NAME_CUT,
    cut,
    dtype_of,
    recv_header,
    recv_tensors,
    send_frame,
    tensor_nbytes,
)
from digen.errors import DigenError, PayloadError

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0
AUTH_S = 5.0
"""How long a new blob-server connection has to authenticate (its TLS handshake and a first
request with a valid MAC) before it is dropped (``security.auth_s``). A peer of the job takes a
round trip or two; the deadline is what an idle connection may hold a thread for."""
IO_TIMEOUT_S = 300.0
"""A fetch whose peer sends nothing for this long fails (a hung or partitioned peer)."""
PROTOCOL = "digen-blob/2"


class BlobLost(DigenError):
    """A blob that cannot be fetched: its server is unreachable or no longer has it."""


class BlobMismatch(BlobLost):
    """A blob whose answer is not what was published: another blob under the same name, a
    wrong version, a manifest without the job's proof, bytes that differ from their digest."""


@dataclass(frozen=True)
class Expect:
    """What the control plane published about a blob (None: not checked)."""

    digest: str | None = None
    version: int | None = None


@dataclass
class Blob:
    """A stored blob. Its manifest is made (its tensors hashed) the first time it is asked
    for: when the producer publishes the digest (a group's trajectories, a gradient), else when
    the blob is first served. A blob nobody fetches (most optimizer states) is never hashed.
    ``snapshot``: where the tensors of a blob put with :meth:`BlobStore.put_snapshot` come
    from, called once, on the first ask, before the hashing (a :class:`BlobLost` it raises
    answers that request as a missing blob and leaves the next ask to call it again)."""

    tensors: dict[str, torch.Tensor]
    meta: dict[str, str] = field(default_factory=dict)
    name: str = ""
    producer: str = ""
    _made: tuple[dict[str, Any], str] | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    snapshot: Callable[[], dict[str, torch.Tensor]] | None = field(default=None, repr=False)

    def _make(self) -> tuple[dict[str, Any], str]:
        with self._lock:  # concurrent first requests wait for one hashing
            if self._made is None:
                if self.snapshot is not None:
                    self.tensors = dict(self.snapshot())
                    self.snapshot = None
                manifest = make_manifest(self.name, self.tensors, self.meta, self.producer)
                self._made = (manifest, manifest_digest(manifest))
            return self._made

    @property
    def manifest(self) -> dict[str, Any]:
        """Identity, metadata and every tensor's name, dtype, shape and digest."""
        return self._make()[0]

    @property
    def digest(self) -> str:
        """The manifest's digest: what a consumer checks the blob against."""
        return self._make()[1]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def make_manifest(
    name: str, tensors: dict[str, torch.Tensor], meta: dict[str, str], producer: str
) -> dict[str, Any]:
    """The manifest of blob ``name`` (its version is ``meta["version"]`` when that is set)."""
    digests = tensor_digests(tensors, ALGORITHM)
    version = meta.get("version")
    return {
        "hash": ALGORITHM,
        "job": job_of(name),
        "name": name,
        "version": int(version) if version is not None and str(version).lstrip("-").isdigit() else None,
        "producer": producer,
        "meta": dict(meta),
        "tensors": [
            {"name": n, "dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "digest": digests[n]}
            for n, t in tensors.items()
        ],
    }


class BlobStore:
    """The blobs this process serves, by name. Thread-safe; a blob is immutable once put
    (a new version of something is a new name), so readers need no lock while sending."""

    def __init__(self, producer: str | None = None) -> None:
        self._blobs: dict[str, Blob] = {}
        self._lock = threading.Lock()
        self.producer = producer or incarnation()
        """Who makes this store's blobs (the worker's name and its process's incarnation)."""

    def put(self, name: str, tensors: dict[str, torch.Tensor], meta: dict[str, str] | None = None) -> Blob:
        meta = {str(k): str(v) for k, v in (meta or {}).items()}
        blob = Blob(dict(tensors), meta, name, self.producer)
        with self._lock:
            self._blobs[name] = blob
        return blob

    def put_snapshot(
        self, name: str, snapshot: Callable[[], dict[str, torch.Tensor]], meta: dict[str, str] | None = None
    ) -> Blob:
        """A blob whose tensors are ``snapshot()``, taken when it is first asked for (so a
        blob nobody fetches costs no copy); until then its :attr:`Blob.nbytes` is 0."""
        blob = self.put(name, {}, meta)
        blob.snapshot = snapshot
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
@dataclass(frozen=True)
class Request:
    op: str
    blob: str
    names: list[str] | None
    exclude: list[str]
    dtype: torch.dtype | None
    seq: int
    nonce: str


def parse_request(req: dict[str, Any]) -> Request:
    """A request's fields, checked (:class:`PayloadError` naming the first bad one)."""

    def strings(v: Any) -> bool:
        return isinstance(v, list) and all(isinstance(x, str) for x in v)

    op, name, names = req.get("op"), req.get("blob"), req.get("names")
    exclude, dtype, seq, nonce = req.get("exclude") or [], req.get("dtype"), req.get("seq"), req.get("nonce")
    if op not in ("get", "describe"):
        raise PayloadError(f"unknown request op {cut(op, 40)}")
    if not isinstance(name, str) or not name:
        raise PayloadError("a request names no blob")
    if names is not None and not strings(names):
        raise PayloadError("'names' must be a list of strings")
    if not strings(exclude):
        raise PayloadError("'exclude' must be a list of strings")
    if dtype is not None and dtype not in DTYPES:
        raise PayloadError(f"unknown dtype {cut(dtype, 40)}")
    if seq is None or nonce is None:  # no credential at all: refused as a wrong one is
        seq, nonce = -1, ""
    if not isinstance(seq, int) or isinstance(seq, bool) or not isinstance(nonce, str) or len(nonce) > 64:
        raise PayloadError("a request's sequence number or nonce is malformed")
    return Request(op, name, names, list(exclude), None if dtype is None else DTYPES[dtype], seq, nonce)


class BlobServer:
    """Serves a :class:`BlobStore` on a TCP port: at most ``max_pending`` connections waiting
    to authenticate, on the one thread of its :class:`~digen.dataplane.gate.Gate` (the oldest
    dropped for a new one), and ``max_conns`` authenticated, a thread each (``max_per_peer``
    per requester identity). Only requests signed
    with the key of the blob's job (in ``keys``, default this process's
    :func:`~digen.dataplane.auth.keyring`) are answered.

    Frames (headers; ``get`` answers carry tensors)::

        server, on connect: {"hello": PROTOCOL, "nonce": N}
        {"op": "get", "blob": NAME, "names": [..] | null, "exclude": [..], "dtype": "bfloat16" | null,
         "seq": S, "nonce": C, "from": WHO, "mac": HMAC}
            -> {"ok": true, "meta": {...}, "manifest": {...}, "digest": D, "proof": P} + the
               tensors (``names``, else all but ``exclude``; floating ones cast to dtype when given)
        {"op": "describe", ...same fields} -> the same header, no tensors
        a missing blob or tensor -> {"ok": false, "error": "missing", "message": ...}
        a bad request -> {"ok": false, "error": "bad", ...}, then the connection closes
        a wrong or absent MAC -> {"ok": false, "error": "refused", ...}, then it closes
        over a connection cap -> {"ok": false, "error": "busy", ...} to the first request, then
            it closes

    :attr:`counts` tallies what the server did (``served``, ``refused``, ``bad``, ``timed_out``
    (any deadline), ``auth_timeout`` (not authenticated within ``auth_s``: counted in
    ``timed_out`` too), ``evicted``, ``busy``, ``accept_failed``), for logs and tests.
    """

    def __init__(
        self,
        store: BlobStore,
        host: str = "127.0.0.1",
        port: int = 0,
        ssl_context: ssl.SSLContext | None = None,
        advertise: str | None = None,
        *,
        keys: Keyring | None = None,
        max_conns: int = 64,
        max_per_peer: int = 16,
        max_pending: int = 64,
        auth_s: float = AUTH_S,
        idle_s: float = 120.0,
        header_s: float = 10.0,
        request_s: float = IO_TIMEOUT_S,
        handshake_s: float = 10.0,
        max_request: int = 2**20,
        backoff_s: float = 0.05,
    ):
        self.store = store
        self.ssl_context = ssl_context
        self.keys = keys if keys is not None else keyring()
        self.max_conns, self.max_per_peer, self.max_pending = max_conns, max_per_peer, max_pending
        self.auth_s = auth_s
        self.idle_s, self.header_s, self.request_s = idle_s, header_s, request_s
        self.handshake_s, self.max_request, self.backoff_s = handshake_s, max_request, backoff_s
        self.sock = socket.create_server((host, port), reuse_port=False)
        self.sock.listen(64)
        bound_host, bound_port = self.sock.getsockname()[:2]
        self.address = f"{advertise or bound_host}:{bound_port}"
        self.bytes_sent = 0
        """Tensor bytes served (counted before they go out, so a client that has them sees them counted)."""
        self.counts: Counter[str] = Counter()
        self._peers: Counter[str] = Counter()
        """Authenticated connections per requester identity."""
        self._serving = 0
        """Authenticated connections open now (a thread each)."""
        self._lock = threading.Lock()
        self._gate = Gate(
            self.sock,
            self.address,
            protocol=PROTOCOL,
            first=self._first,
            count=self._count,
            ssl_context=ssl_context,
            max_pending=max_pending,
            auth_s=auth_s,
            handshake_s=handshake_s,
            header_s=header_s,
            idle_s=idle_s,
            max_request=max_request,
            backoff_s=backoff_s,
        )

    @property
    def active(self) -> int:
        """Connections open now (authenticated or not)."""
        with self._lock:
            return self._serving + self._gate.open

    @property
    def pending(self) -> int:
        """Connections open now that have not authenticated yet."""
        return self._gate.pending

    def close(self, wait_s: float = 2.0) -> None:
        """Stop accepting: the gate closes the listener and every connection waiting to
        authenticate, and this waits up to ``wait_s`` for its thread to end, so a closed server
        leaves no thread of its own behind that outlives it. Authenticated connections finish
        on their own threads."""
        self._gate.close(wait_s)

    def _count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self.counts[what] += n

    # --- a first request (on the gate's thread) -----------------------------------------------
    def _first(self, w: Waiting, raw: dict[str, Any]) -> dict[str, Any] | None:
        """The verdict on a connection's first request: a refusal or a ``busy`` answer (to
        send, then close), or None once a serving thread has the connection, now counted as
        its requester's. Blocks on nothing: two HMACs and the caps."""
        req = parse_request(raw)  # PayloadError: the gate answers "bad"
        key = self._verified(req, raw, w.nonce, 0, w.peer)
        if key is None:
            return REFUSED
        who = f"{job_of(req.blob)}/{cut(raw.get('from'), NAME_CUT)}"  # the MAC covers both
        with self._lock:
            if self._serving >= self.max_conns or self._peers[who] >= self.max_per_peer:
                self.counts["busy"] += 1
                return BUSY
            self._peers[who] += 1
            self._serving += 1
        thread = threading.Thread(
            target=self._serve,
            args=(w.sock, w.peer, who, w.nonce, req, key),
            name="digen-blob-conn",
            daemon=True,
        )
        try:
            thread.start()
        except RuntimeError:  # no thread to be had: as good as full
            self._left(who)
            self._count("busy")
            return BUSY
        return None

    def _verified(self, req: Request, raw: dict[str, Any], nonce: str, seq: int, peer: str) -> bytes | None:
        """The key of ``req``'s job when its MAC and sequence number hold, else None (counted
        ``refused``)."""
        key = self.keys.get(job_of(req.blob))
        if key is None or req.seq != seq or not same(raw.get("mac"), request_mac(key, nonce, raw)):
            self._count("refused")
            log.debug("blob server: refused a request for %s from %s", cut(req.blob), peer)
            return None
        return key

    def _left(self, who: str) -> None:
        with self._lock:
            self._serving -= 1
            self._peers[who] -= 1
            if self._peers[who] <= 0:
                del self._peers[who]

    # --- an authenticated connection (a thread of its own) -----------------------------------
    def _serve(self, conn: socket.socket, peer: str, who: str, nonce: str, req: Request, key: bytes) -> None:
        try:
            self._reply(conn, req, key)
            seq = 1
            while True:
                try:
                    raw = recv_header(
                        conn, max_header=self.max_request, idle_s=self.idle_s, header_s=self.header_s
                    )
                except ConnectionError:
                    return  # the client is done
                if not self._answer(conn, peer, raw, nonce, seq):
                    return
                seq += 1
        except TimeoutError as exc:
            self._count("timed_out")
            log.debug("blob server: connection from %s timed out (%s)", peer, exc)
        except PayloadError as exc:
            self._count("bad")
            log.debug("blob server: bad frame from %s: %s", peer, cut(exc, 200))
            with contextlib.suppress(OSError):
                conn.settimeout(1.0)
                send_frame(conn, {"ok": False, "error": "bad", "message": cut(exc, 200)})
                _linger(conn)
        except (OSError, ssl.SSLError) as exc:
            log.debug("blob server: connection from %s ended (%s)", peer, cut(exc, 200))
        except Exception as exc:  # noqa: BLE001 - a peer's bytes must never print a traceback
            self._count("bad")  # on the job's console nor end the server: one debug line
            log.debug("blob server: request from %s failed", peer, exc_info=exc)
        finally:
            self._left(who)
            with contextlib.suppress(OSError):
                conn.close()

    def _answer(self, conn: socket.socket, peer: str, raw: dict[str, Any], nonce: str, seq: int) -> bool:
        """Answer a later request of an authenticated connection; False: the connection ends
        (a refused request)."""
        req = parse_request(raw)  # PayloadError: an error frame, then the connection ends
        key = self._verified(req, raw, nonce, seq, peer)
        if key is None:
            send_frame(conn, REFUSED, deadline=time.monotonic() + self.request_s)
            _linger(conn)
            return False
        self._reply(conn, req, key)
        return True

    def _reply(self, conn: socket.socket, req: Request, key: bytes) -> None:
        """Send the answer to an authenticated request (the blob, its description, or
        ``missing``) within ``request_s``."""
        deadline = time.monotonic() + self.request_s
        blob = self.store.get(req.blob)
        if blob is None:
            send_frame(conn, {"ok": False, "error": "missing", "message": f"no blob {cut(req.blob)}"})
            return
        try:
            manifest, digest = blob.manifest, blob.digest
        except BlobLost as exc:  # a snapshot whose source moved on (a trainer's state, stepped)
            send_frame(conn, {"ok": False, "error": "missing", "message": cut(exc, 200)}, deadline=deadline)
            return
        head = {
            "ok": True,
            "meta": blob.meta,
            "manifest": manifest,
            "digest": digest,
            "proof": proof_mac(key, req.nonce, digest),
        }
        if req.op == "describe":
            send_frame(conn, head, deadline=deadline)
            return
        wanted = [n for n in blob.tensors if n not in set(req.exclude)] if req.names is None else req.names
        missing = [n for n in wanted if n not in blob.tensors]
        if missing:
            msg = f"{cut(req.blob)} has no tensor {cut(missing[0])}"
            send_frame(conn, {"ok": False, "error": "missing", "message": msg}, deadline=deadline)
            return
        out = {n: blob.tensors[n] for n in wanted}
        size = sum(
            t.numel()
            * (req.dtype.itemsize if req.dtype is not None and t.is_floating_point() else t.element_size())
            for t in out.values()
        )
        with self._lock:
            self.bytes_sent += size
            self.counts["served"] += 1
        send_frame(conn, head, out, cast=req.dtype, deadline=deadline)


REFUSED = {"ok": False, "error": "refused", "message": "not authorized"}
BUSY = {"ok": False, "error": "busy", "message": "too many connections"}


def _linger(conn: socket.socket, limit: int = LINGER_BYTES, wait_s: float = LINGER_S) -> None:
    """Before closing on a refused or bad request: send our FIN, then read (and drop) what the
    peer already sent, a little of it for a little while. Closing with unread bytes would
    send a reset, and the peer could lose the refusal frame that went out just before. The
    blocking twin of the gate's linger (on a serving thread), with the gate's bounds."""
    conn.shutdown(socket.SHUT_WR)
    conn.settimeout(wait_s)
    end, got = time.monotonic() + wait_s, 0
    with contextlib.suppress(OSError):
        while got < limit and time.monotonic() < end:
            chunk = conn.recv(min(65536, limit - got))
            if not chunk:
                return
            got += len(chunk)


# --- client ----------------------------------------------------------------------------
_CLIENT_SSL: ssl.SSLContext | None = None


@dataclass
class Channel:
    """An open connection to a blob server: the server's nonce, the next request's number."""

    sock: socket.socket
    address: str
    nonce: str
    seq: int = 0
    broken: bool = False


@contextlib.contextmanager
def connection(address: str, ssl_context: ssl.SSLContext | None = None) -> Iterator[Channel]:
    """A connection to the blob server at ``host:port`` (:class:`BlobLost` when it cannot be
    reached, or is over its connection cap)."""
    host, _, port = address.rpartition(":")
    ctx = ssl_context if ssl_context is not None else _CLIENT_SSL
    try:
        sock = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S)
    except (OSError, ValueError) as exc:
        raise BlobLost(f"blob server {cut(address)} unreachable ({exc})") from None
    try:
        try:
            if ctx is not None:
                sock = ctx.wrap_socket(sock)
            sock.settimeout(IO_TIMEOUT_S)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hello = recv_header(sock, max_header=4096)
        except (OSError, ssl.SSLError, PayloadError) as exc:
            raise BlobLost(f"blob server {cut(address)}: no hello ({exc})") from None
        if hello.get("hello") != PROTOCOL or not isinstance(hello.get("nonce"), str):
            raise BlobLost(f"blob server {cut(address)}: {cut(hello.get('message', 'not a blob server'))}")
        yield Channel(sock, address, hello["nonce"])
    finally:
        with contextlib.suppress(OSError):
            sock.close()


def _signed(ch: Channel, req: dict[str, Any], keys: Keyring) -> dict[str, Any]:
    job = job_of(req["blob"])
    key = keys.get(job)
    if key is None:
        raise BlobLost(f"blob {cut(req['blob'])}: this process has no key for job {cut(job)}")
    req = {**req, "seq": ch.seq, "nonce": new_nonce(), "from": incarnation()}  # who asks: the MAC covers it
    req["mac"] = request_mac(key, ch.nonce, req)
    ch.seq += 1
    return req


def _request(ch: Channel, req: dict[str, Any]) -> dict[str, Any]:
    if ch.broken:
        raise BlobLost(f"blob server {cut(ch.address)}: the connection is out of step")
    try:
        send_frame(ch.sock, req)
        head = recv_header(ch.sock)
    except (OSError, ssl.SSLError, PayloadError) as exc:
        raise BlobLost(
            f"blob {cut(req.get('blob'))} at {cut(ch.address)}: connection failed ({exc})"
        ) from None
    if not head.get("ok"):
        msg = f"blob {cut(req.get('blob'))} at {cut(ch.address)}: {cut(head.get('message', 'refused'), 200)}"
        raise BlobLost(msg)
    return head


def _mismatch(ch: Channel, name: str, producer: object, why: str) -> BlobMismatch:
    """A wrong answer: one warning naming the producer, the connection closed (unread bytes
    would put it out of step), and the error to raise."""
    ch.broken = True
    with contextlib.suppress(OSError):
        ch.sock.close()
    msg = f"blob {cut(name)} at {cut(ch.address)} (producer {cut(producer)}) is not what was published: {why}"
    log.warning("%s; treated as lost", msg)
    return BlobMismatch(msg)


def _checked_manifest(
    ch: Channel, name: str, head: dict[str, Any], req: dict[str, Any], keys: Keyring, expect: Expect | None
) -> dict[str, Any]:
    """The answer's manifest once its proof, its digest, its identity and ``expect`` hold."""
    manifest, digest = head.get("manifest"), head.get("digest")
    producer = manifest.get("producer") if isinstance(manifest, dict) else None
    key = keys.get(job_of(name))
    if (
        key is None
        or not isinstance(digest, str)
        or not same(head.get("proof"), proof_mac(key, req["nonce"], digest))
    ):
        raise _mismatch(ch, name, producer, "the answer has no proof of the job's key")
    if not isinstance(manifest, dict) or manifest_digest(manifest) != digest:
        raise _mismatch(ch, name, producer, "its manifest does not match its digest")
    if manifest.get("job") != job_of(name) or manifest.get("name") != name:
        raise _mismatch(ch, name, producer, f"it is {cut(manifest.get('name'))}")
    if expect is not None and expect.digest is not None and digest != expect.digest:
        raise _mismatch(ch, name, producer, "another blob under the same name (digest differs)")
    if expect is not None and expect.version is not None and manifest.get("version") != expect.version:
        raise _mismatch(ch, name, producer, f"version {manifest.get('version')}, not {expect.version}")
    if manifest.get("hash") not in ALGORITHMS:
        raise _mismatch(ch, name, producer, f"its digests use {cut(manifest.get('hash'), 40)}, unknown here")
    if not isinstance(manifest.get("tensors"), list) or not all(
        isinstance(e, dict) and isinstance(e.get("name"), str) for e in manifest["tensors"]
    ):
        raise _mismatch(ch, name, producer, "its manifest lists no tensors")
    return manifest


def fetch(
    address: str,
    name: str,
    *,
    names: list[str] | None = None,
    exclude: tuple[str, ...] | list[str] = (),
    dtype: torch.dtype | None = None,
    sock: Channel | None = None,
    expect: Expect | None = None,
    max_bytes: int | None = None,
    keys: Keyring | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Blob ``name`` from the server at ``address`` (only ``names`` of its tensors when
    given, else all but ``exclude``; floating tensors cast to ``dtype`` by the server when
    given): (tensors, meta). ``sock``: an open :func:`connection` to reuse. ``expect``: what the
    control plane published (digest, version). ``max_bytes``: the most this fetch takes in
    (else what the manifest announces). Every answer is checked (see the module docstring):
    :class:`BlobMismatch` when it is not the blob published."""
    keys = keys if keys is not None else keyring()
    if sock is None:
        with connection(address) as ch:
            return fetch(
                address, name, names=names, exclude=exclude, dtype=dtype, sock=ch, expect=expect,
                max_bytes=max_bytes, keys=keys,
            )  # fmt: skip
    ch = sock
    req = _signed(
        ch,
        {
            "op": "get",
            "blob": name,
            "names": names,
            "exclude": list(exclude),
            "dtype": DTYPE_NAMES[dtype] if dtype is not None else None,
        },
        keys,
    )
    head = _request(ch, req)
    manifest = _checked_manifest(ch, name, head, req, keys, expect)
    entries = {e["name"]: e for e in manifest["tensors"]}
    skip = set(exclude)
    wanted = [n for n in entries if n not in skip] if names is None else list(names)
    sent = head.get("tensors", [])
    producer = manifest.get("producer")
    if [s["name"] for s in sent] != wanted or any(n not in entries for n in wanted):
        raise _mismatch(ch, name, producer, "it sent other tensors than were asked for")
    hashed = []
    for s in sent:
        e = entries[s["name"]]
        cast = dtype is not None and dtype_of(e["dtype"]).is_floating_point
        want_dtype = DTYPE_NAMES[dtype] if cast else e["dtype"]
        if s["shape"] != e["shape"] or s["dtype"] != want_dtype:
            raise _mismatch(ch, name, producer, f"tensor {cut(s['name'])} is not as its manifest says")
        if s["dtype"] == e["dtype"]:
            hashed.append(s["name"])
    digests: dict[str, str] = {}
    try:
        tensors = recv_tensors(
            ch.sock, head, max_bytes=max_bytes, hashed=hashed, digests=digests, algorithm=manifest["hash"]
        )
    except (OSError, ssl.SSLError, PayloadError) as exc:
        ch.broken = True
        raise BlobLost(
            f"blob {cut(name)} at {cut(address)}: connection failed mid-transfer ({exc})"
        ) from None
    bad = [n for n in hashed if digests[n] != entries[n].get("digest")]
    if bad:
        raise _mismatch(ch, name, producer, f"the bytes of tensor {cut(bad[0])} differ from its digest")
    return tensors, {str(k): str(v) for k, v in (head.get("meta") or {}).items()}


def describe(
    address: str, name: str, *, expect: Expect | None = None, keys: Keyring | None = None
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """(tensor specs ``{name, dtype, shape}``, meta) of blob ``name``, no tensor bytes (its
    manifest checked as :func:`fetch` checks it)."""
    keys = keys if keys is not None else keyring()
    with connection(address) as ch:
        req = _signed(ch, {"op": "describe", "blob": name}, keys)
        head = _request(ch, req)
        manifest = _checked_manifest(ch, name, head, req, keys, expect)
    specs = [{"name": e["name"], "dtype": e["dtype"], "shape": e["shape"]} for e in manifest["tensors"]]
    return specs, dict(head.get("meta") or {})


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


def local_server(
    host: str = "127.0.0.1", tls: tuple[str, str, str] | None = None, auth_s: float = AUTH_S
) -> BlobServer:
    """This process's blob server over :func:`local_store`, started on first use, listening on
    ``host`` (the address peers reach this process at: a Dask worker's host). ``tls``: (CA,
    certificate, key) files: mutual TLS for the server and every fetch from this process.
    ``auth_s``: :attr:`BlobServer.auth_s` (the first use's)."""
    global _CLIENT_SSL
    store = local_store()
    with _LOCAL_LOCK:
        server = _LOCAL.get("server")
        if server is None:
            server_ctx = None
            if tls is not None:
                server_ctx, _CLIENT_SSL = tls_contexts(*tls)
            server = _LOCAL["server"] = BlobServer(store, host=host, ssl_context=server_ctx, auth_s=auth_s)
            log.info("blob server of process listening at %s", server.address)
        return server
