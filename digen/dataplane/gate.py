"""Where a blob server's new connections wait to authenticate: one selector loop, no thread each.

A :class:`~digen.dataplane.blobs.BlobServer` answers only requests signed with a job's key,
and anyone who can reach its port (another user of a shared GPU box, any host that reaches a
job listening on a LAN address) may open connections that never sign anything. The
:class:`Gate` is the one thread that accepts them and walks each through what comes before
its first authenticated request, without blocking on any of them:

1. over TLS, the handshake: ``do_handshake`` each time the socket is ready, within
   ``handshake_s`` (and ``auth_s``); the TLS object is made when the first byte arrives, so a
   connection that never sends one costs a descriptor and nothing more;
2. the hello frame with the connection's nonce;
3. the first request's header: its first byte within ``idle_s`` of the hello, the rest within
   ``header_s`` of that byte, at most ``max_request`` bytes, all within ``auth_s`` of the
   connection's start;
4. the server's verdict on that request (:attr:`Gate.first`): a refusal, a ``busy`` or a
   ``bad`` answer goes out from here too, then the connection lingers (reads and drops what
   the peer sent, for :data:`LINGER_S`) and closes; an authenticated one leaves the gate,
   blocking again, for the serving thread the server's verdict started, with its nonce and its
   first request.

At most ``max_pending`` connections wait here; a new one drops the oldest waiting
(``evicted``), so a real peer, which authenticates within a round trip of the hello, is never
kept out by connections that never do. ``accept`` failing (``EMFILE``, ``ECONNABORTED``...)
stops accepting for a back-off doubling from ``backoff_s`` to 1 s, logged once per kind of
error, while the connections already waiting go on.

Why a loop and not a thread per connection: the thread per connection it replaces made a
flood of more than ``max_pending`` connections cost a thread start, a TLS socket and an
eviction handshake between threads for every one the attacker opened (about 300 a second:
each new one drops the oldest and the attacker reopens it at once), 0.13-0.19 of a core in
the server's process (0.4-0.6 ms a connection), and the job's iterations 65% slower on the
mean of seven measured rounds; with the gate, 0.1 ms a connection and +17%
(docs/dataplane.md, "A server that survives abuse"). Here a waiting connection is an
entry in a dict and a descriptor in an ``epoll`` set, its deadlines are checked in one pass
over at most ``max_pending`` entries per wake-up, and an eviction is a ``close``. The work the
gate does for a connection is bounded by its bytes: a hello out, at most a TLS handshake's and
``max_request`` bytes in, one answer frame out; nothing it does blocks, so one slow or silent
peer delays no other. Threads remain for authenticated connections only, at most the server's
``max_conns``: their answers (whole weight versions, cast tensor by tensor) are long writes
that a loop would have to interleave, and a pool would bound them no better than the caps do.

What the gate holds is bounded too: at most ``max_pending`` connections waiting and as many
being closed after an answer (:data:`ANSWER_S`, then :data:`LINGER_S`; the oldest closed at
once for a new one); per connection at most ``max_request`` bytes of request, kept as they
arrive (never allocated from the length a peer announces); per wake-up at most
:data:`ACCEPT_BATCH` accepts and one pass over those deadlines.

No per-address connection rate: every process on a machine reaches a loopback server from
127.0.0.1, so a limit by address would let another local user refuse the job's own fetches by
spending that address's allowance (as the per-address cap the identity caps replaced did);
and with the gate a dropped connection costs the server about 0.1 ms of CPU, so the churn such
a limit would slow is no longer what costs the job.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from digen.dataplane.auth import new_nonce
from digen.dataplane.wire import PREFIX, cut, decode_header, encode_header, header_length
from digen.errors import PayloadError

log = logging.getLogger("digen.dataplane.blobs")  # the server's log: one place to look

LINGER_S = 0.2
"""After a refusal or a bad request: how long the gate reads and drops what the peer had
sent before it closes (closing with unread bytes sends a reset, and the peer could lose the
answer that went out just before)."""
LINGER_BYTES = 2**16
ANSWER_S = 1.0
"""How long the gate gives a refusal or ``bad`` frame to go out."""
ACCEPT_BATCH = 64
"""Connections accepted per wake-up at most, so a burst of them delays the others' steps
by a bounded amount."""
_LISTENER, _WAKE = "listener", "wake"


@dataclass(eq=False)
class Waiting:
    """A connection that has not authenticated yet."""

    ticket: int
    fd: int
    sock: socket.socket
    """The TCP socket, then the TLS socket over it once the first byte has come."""
    peer: str
    auth_by: float
    stage: str = "handshake"
    """``handshake``, ``hello``, ``request``, ``answer`` (a refusal going out), ``linger``."""
    until: float = 0.0
    """When the current stage's deadline passes."""
    nonce: str = ""
    out: bytes = b""
    got: bytearray = field(default_factory=bytearray)
    need: int = PREFIX
    """Bytes of the request frame wanted so far: its prefix, then the prefix and the header."""
    dropped: int = 0
    """Bytes read and dropped while lingering."""
    events: int = 0
    """What the selector waits for on ``fd`` (0: not registered)."""


First = Callable[[Waiting, dict[str, Any]], "dict[str, Any] | None"]
"""The server's verdict on a connection's first request: ``None`` when it authenticated and
the server took the connection (:attr:`Gate.serve` was called), else the frame to answer
before closing (the server counted it). A :class:`PayloadError` is a ``bad`` request."""


class Gate:
    """The accept loop and the connections that wait to authenticate (see the module
    docstring), saying ``protocol`` in its hello. ``first``: the server's verdict on a first request; ``count``: the server's
    tally (``evicted``, ``timed_out``, ``auth_timeout``, ``bad``, ``accept_failed``)."""

    def __init__(
        self,
        listener: socket.socket,
        name: str,
        *,
        protocol: str,
        first: First,
        count: Callable[[str], None],
        ssl_context: ssl.SSLContext | None,
        max_pending: int,
        auth_s: float,
        handshake_s: float,
        header_s: float,
        idle_s: float,
        max_request: int,
        backoff_s: float,
    ) -> None:
        self.listener, self.name, self.protocol = listener, name, protocol
        self.first, self.count = first, count
        self.ssl_context = ssl_context
        self.max_pending, self.auth_s, self.handshake_s = max_pending, auth_s, handshake_s
        self.header_s, self.idle_s, self.max_request, self.backoff_s = (
            header_s,
            idle_s,
            max_request,
            backoff_s,
        )
        self._waiting: dict[int, Waiting] = {}
        """Connections whose first request is not judged yet, oldest first (tickets increase).
        Touched by the loop's thread only."""
        self._closing: dict[int, Waiting] = {}
        """Connections judged and being closed (an answer going out, lingering), oldest first:
        at most ``max_pending`` too, the oldest closed at once for a new one."""
        self._tickets = 0
        self._failures = 0
        self._resume_at: float | None = None
        """While accepting is backed off: when to accept again."""
        self._logged: set[int] = set()
        self._closed = False
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        listener.setblocking(False)
        self._sel.register(listener.fileno(), selectors.EVENT_READ, _LISTENER)
        self._sel.register(self._wake_r.fileno(), selectors.EVENT_READ, _WAKE)
        self.thread = threading.Thread(target=self._run, name="digen-blob-server", daemon=True)
        self.thread.start()

    @property
    def pending(self) -> int:
        """Connections waiting to authenticate now (read from any thread: a dict's length)."""
        return len(self._waiting)

    @property
    def open(self) -> int:
        """Connections the gate holds now: waiting, and judged but not closed yet."""
        return len(self._waiting) + len(self._closing)

    def close(self, wait_s: float) -> None:
        """Stop: the loop closes the listener and every waiting connection, then ends; wait
        up to ``wait_s`` for it."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if threading.current_thread() is not self.thread:
            self.thread.join(wait_s)

    # --- the loop --------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            next_at: float | None = None
            while not self._closed:
                now = time.monotonic()
                if self._resume_at is not None and now >= self._resume_at:
                    self._resume_at = None
                    with contextlib.suppress(OSError, ValueError):
                        self._sel.register(self.listener.fileno(), selectors.EVENT_READ, _LISTENER)
                wake = [t for t in (next_at, self._resume_at) if t is not None]
                timeout = max(0.0, min(wake) - now) if wake else None
                try:
                    for key, _ in self._sel.select(timeout):
                        if key.data is _LISTENER:
                            self._accept()
                        elif key.data is _WAKE:
                            with contextlib.suppress(OSError):
                                self._wake_r.recv(4096)
                        elif self._holds(key.data):  # not dropped earlier in this pass
                            self._advance(key.data)
                    next_at = self._expire(time.monotonic())
                except Exception:  # a fault of the gate's own: the server must keep serving
                    log.warning(
                        "blob server %s: error in its accept loop; going on", self.name, exc_info=True
                    )
                    next_at = time.monotonic() + 0.1
        finally:
            for w in [*self._waiting.values(), *self._closing.values()]:
                self._end(w)
            with contextlib.suppress(OSError):
                self.listener.close()
            self._sel.close()
            self._wake_r.close()
            self._wake_w.close()

    def _expire(self, now: float) -> float | None:
        """End every connection whose stage's deadline passed; the next deadline."""
        soonest = None
        for w in [*self._waiting.values(), *self._closing.values()]:
            if now < w.until:
                soonest = w.until if soonest is None else min(soonest, w.until)
            elif w.stage in ("answer", "linger"):
                self._end(w)
            else:
                self.count("timed_out")
                self.count("auth_timeout")
                log.debug("blob server: connection from %s timed out (%s)", w.peer, w.stage)
                self._end(w)
        return soonest

    # --- accepting -------------------------------------------------------------------------
    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                conn, peer = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if self._closed:
                    return
                self._failures += 1
                self._accept_failed(exc)
                return
            self._failures = 0
            try:
                w = self._admit(conn, str(peer[0]))
            except OSError as exc:  # reset before it was ever looked at
                log.debug("blob server: connection from %s ended (%s)", peer[0], cut(exc, 200))
                with contextlib.suppress(OSError):
                    conn.close()
                continue
            if w.stage == "hello":
                self._advance(w)

    def _accept_failed(self, exc: OSError) -> None:
        """Out of file descriptors (``EMFILE``/``ENFILE``), a connection reset before it was
        accepted (``ECONNABORTED``), anything else: stop accepting for a while (doubling up to
        1 s; the connection stays in the kernel's queue, so the listener stays readable and
        is left out of the selector meanwhile), then accept again. Logged once per kind of
        error: a flood must not flood the log too."""
        self.count("accept_failed")
        code = exc.errno or 0
        if code not in self._logged:
            self._logged.add(code)
            log.warning(
                "blob server %s: accept failed (%s); backing off and retrying",
                self.name,
                errno.errorcode.get(code, str(exc)),
            )
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(self.listener.fileno())
        self._resume_at = time.monotonic() + min(1.0, self.backoff_s * 2 ** min(self._failures - 1, 5))

    def _admit(self, conn: socket.socket, peer: str) -> Waiting:
        """A new connection waits; at ``max_pending`` waiting, the oldest is dropped first."""
        while len(self._waiting) >= self.max_pending:
            self.count("evicted")
            self._end(next(iter(self._waiting.values())))
        conn.setblocking(False)
        with contextlib.suppress(OSError):
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._tickets += 1
        now = time.monotonic()
        w = Waiting(self._tickets, conn.fileno(), conn, peer, auth_by=now + self.auth_s)
        self._waiting[w.ticket] = w
        if self.ssl_context is None:
            w.stage = "hello"
        else:
            w.until = min(w.auth_by, now + self.handshake_s)
            self._want(w, selectors.EVENT_READ)
        return w

    # --- one connection's steps --------------------------------------------------------------
    def _advance(self, w: Waiting) -> None:
        """Take ``w`` as far as its bytes allow, never blocking."""
        try:
            if w.stage == "handshake":
                self._handshake(w)
            elif w.stage == "hello" and not w.nonce:  # a plain connection, just accepted
                self._hello(w, time.monotonic())
            elif w.stage in ("hello", "answer"):
                self._flush(w)
            elif w.stage == "request":
                self._read(w)
            else:
                self._linger(w)
        except PayloadError as exc:
            self.count("bad")
            log.debug("blob server: bad frame from %s: %s", w.peer, cut(exc, 200))
            self._answer(w, {"ok": False, "error": "bad", "message": cut(exc, 200)})
        except (OSError, ssl.SSLError) as exc:  # a failed handshake, a reset, a closed peer
            log.debug("blob server: connection from %s ended (%s)", w.peer, cut(exc, 200))
            self._end(w)
        except Exception as exc:  # noqa: BLE001 - a peer's bytes must never end the loop
            self.count("bad")
            log.debug("blob server: request from %s failed", w.peer, exc_info=exc)
            self._end(w)

    def _handshake(self, w: Waiting) -> None:
        assert self.ssl_context is not None
        if not isinstance(w.sock, ssl.SSLSocket):
            w.sock = self.ssl_context.wrap_socket(w.sock, server_side=True, do_handshake_on_connect=False)
        try:
            w.sock.do_handshake()
        except ssl.SSLWantReadError:
            return self._want(w, selectors.EVENT_READ)
        except ssl.SSLWantWriteError:
            return self._want(w, selectors.EVENT_WRITE)
        self._hello(w, time.monotonic())

    def _hello(self, w: Waiting, now: float) -> None:
        w.nonce = new_nonce()
        w.stage, w.until = "hello", min(w.auth_by, now + self.header_s)
        w.out = encode_header({"hello": self.protocol, "nonce": w.nonce})
        self._flush(w)

    def _flush(self, w: Waiting) -> None:
        """Send what ``w`` has to send; once it is out, the next stage."""
        while w.out:
            try:
                w.out = w.out[w.sock.send(w.out) :]
            except (BlockingIOError, ssl.SSLWantWriteError):
                return self._want(w, selectors.EVENT_WRITE)
            except ssl.SSLWantReadError:
                return self._want(w, selectors.EVENT_READ)
        now = time.monotonic()
        if w.stage == "hello":
            w.stage, w.until = "request", min(w.auth_by, now + self.idle_s)
            self._read(w)  # over TLS, the request may already sit decrypted in the TLS buffer
        else:  # the answer is out: linger, then close
            w.sock.shutdown(socket.SHUT_WR)
            w.stage, w.until = "linger", now + LINGER_S
            self._linger(w)

    def _read(self, w: Waiting) -> None:
        """Read the first request, no byte past its header (what follows is the serving
        thread's), then ask the server for its verdict."""
        while True:
            try:
                chunk = w.sock.recv(min(65536, w.need - len(w.got)))
            except (BlockingIOError, ssl.SSLWantReadError):
                return self._want(w, selectors.EVENT_READ)
            except ssl.SSLWantWriteError:
                return self._want(w, selectors.EVENT_WRITE)
            if not chunk:
                return self._end(w)  # the peer left before asking anything
            if not w.got:  # its first byte: the rest of the header within header_s
                w.until = min(w.auth_by, time.monotonic() + self.header_s)
            w.got += chunk
            if len(w.got) < w.need:
                continue
            if w.need == PREFIX:  # the prefix is in: it says how long the header is
                w.need += header_length(w.got, self.max_request)
                if w.need > PREFIX:
                    continue
            break
        header = decode_header(w.got[PREFIX:])
        if w.events:
            self._sel.unregister(w.fd)
            w.events = 0
        w.sock.setblocking(True)
        try:
            answer = self.first(w, header)
        except BaseException:
            w.sock.setblocking(False)
            raise
        if answer is None:  # authenticated: the server's thread has it now
            del self._waiting[w.ticket]
            return
        w.sock.setblocking(False)
        self._answer(w, answer)

    def _answer(self, w: Waiting, frame: dict[str, Any]) -> None:
        """Send ``frame``, then linger and close: ``w`` waits no more."""
        self._waiting.pop(w.ticket, None)
        while len(self._closing) >= self.max_pending:
            self._end(next(iter(self._closing.values())))
        self._closing[w.ticket] = w
        w.stage, w.until, w.out = "answer", time.monotonic() + ANSWER_S, encode_header(frame)
        self._flush(w)

    def _linger(self, w: Waiting) -> None:
        while w.dropped < LINGER_BYTES:
            try:
                chunk = w.sock.recv(min(65536, LINGER_BYTES - w.dropped))
            except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                return self._want(w, selectors.EVENT_READ)
            if not chunk:
                break
            w.dropped += len(chunk)
        self._end(w)

    def _want(self, w: Waiting, events: int) -> None:
        if w.events == events:
            return
        if w.events:
            self._sel.modify(w.fd, events, w)
        else:
            self._sel.register(w.fd, events, w)
        w.events = events

    def _holds(self, w: Waiting) -> bool:
        return self._waiting.get(w.ticket) is w or self._closing.get(w.ticket) is w

    def _end(self, w: Waiting) -> None:
        """Close ``w`` and forget it."""
        self._waiting.pop(w.ticket, None)
        self._closing.pop(w.ticket, None)
        if w.events:
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._sel.unregister(w.fd)
            w.events = 0
        with contextlib.suppress(OSError):
            w.sock.close()
