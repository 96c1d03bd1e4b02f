"""What the blob-server security tests share: a job whose key this process holds, a server
over a store, and a raw client that speaks the wire format without the job's key."""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator

import torch

from digen.dataplane.auth import keyring, new_key
from digen.dataplane.blobs import BlobServer, BlobStore
from digen.dataplane.wire import recv_header

JOB = "secjob"


@contextlib.contextmanager
def job_key(job: str = JOB) -> Iterator[bytes]:
    """This process holds ``job``'s key for the block (as a worker of the job does)."""
    key = new_key()
    keyring().add(job, key)
    try:
        yield key
    finally:
        keyring().drop(job)


@contextlib.contextmanager
def serving(store: BlobStore | None = None, **options) -> Iterator[tuple[BlobStore, BlobServer]]:
    store = store if store is not None else BlobStore(producer="rollout-0@test")
    server = BlobServer(store, **options)
    try:
        yield store, server
    finally:
        server.close()


def weights(seed: int = 0, n: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.w": torch.randn(8, 16, generator=g) for i in range(n)}


def raw_connection(address: str, source: str | None = None) -> socket.socket:
    """A plain TCP connection to ``address`` (from loopback address ``source`` when given)."""
    host, port = address.rsplit(":", 1)
    return socket.create_connection(
        (host, int(port)), timeout=10, source_address=(source, 0) if source else None
    )


def read_hello(s: socket.socket) -> dict:
    return recv_header(s, max_header=4096)


def until_closed(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    got = b""
    with contextlib.suppress(ConnectionResetError, TimeoutError):
        while chunk := s.recv(65536):
            got += chunk
    return got


def wait_until(done: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    """Poll ``done`` until it holds (the test decides from what the server did; the timeout
    only keeps a broken server from hanging the suite)."""
    end = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def client_hello() -> bytes:
    """The first bytes a TLS client sends (its ClientHello), from a client that never
    finishes: what a peer that stalls in the handshake has sent."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    out = ssl.MemoryBIO()
    obj = ctx.wrap_bio(ssl.MemoryBIO(), out)
    with contextlib.suppress(ssl.SSLWantReadError):
        obj.do_handshake()
    return out.read()


def server_threads() -> Counter[str]:
    """This process's live blob-server threads, by name: the gate of each server
    (``digen-blob-server``) and one per authenticated connection (``digen-blob-conn``)."""
    return Counter(t.name for t in threading.enumerate() if t.name.startswith("digen-blob-"))
