"""Who may read a job's blobs, and who may answer for them: an HMAC with a per-job key.

Every job has a 32-byte key (:func:`new_key`: ``secrets.token_bytes``), made once by the
controller and kept in the job's Redis under its key prefix (:meth:`JobState.blob_key
<digen.controlplane.jobstate.JobState.blob_key>`); the job's Redis is trusted (it holds the job's
tasks already), so every process of the job, and nothing else, reads it there when its loop
starts and adds it to its process's :class:`Keyring`. A blob belongs to the job its name starts
with (``<job>:...``: :func:`digen.core.blobnames.job_of`), and only that job's key opens it.

The exchange, on every connection to a blob server (:mod:`digen.dataplane.blobs`):

1. the server opens with a *hello* frame carrying a fresh random nonce (16 bytes);
2. each request carries ``seq`` (0, 1, 2... on that connection), the requester's name, a
   client nonce, and ``mac`` = HMAC-SHA256(key, server nonce + the request's canonical JSON);
   the server answers a request whose MAC or ``seq`` is wrong with a refusal frame and no data,
   and closes the connection;
3. the answer's ``proof`` = HMAC-SHA256(key, client nonce + the blob's manifest digest) tells
   the consumer that the manifest (the tensors' names, shapes, dtypes and digests) comes from
   a process that holds the key: a process that took over a dead producer's port cannot make
   one.

Replay: a captured request is useless elsewhere, since its MAC covers the server's nonce,
which is new on every connection, and ``seq`` keeps it from being played twice on its own. No
clock is involved (no window to tune across hosts), and the server keeps no nonce cache.

This module is the standard library only: the controller (torch-free) makes the key with it.

Cost: one hello frame per connection (a round trip before the first request, ~0.1 ms on a
LAN, nothing beside a 64 MiB bucket) and two HMACs over a few hundred bytes per request.

With mutual TLS the HMAC still applies: the certificates say "a node of this cluster", the key
says "a process of this job", and a cluster runs many jobs.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import socket
import threading
from typing import Any

KEY_BYTES = 32
NONCE_BYTES = 16


def canonical(obj: Any) -> bytes:
    """The one JSON encoding of ``obj`` that digests and MACs are computed over."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def new_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def new_nonce() -> str:
    return secrets.token_hex(NONCE_BYTES)


def _new_incarnation() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


_INCARNATION = _new_incarnation()


def incarnation() -> str:
    """This process's incarnation: a blob's producer is named by it, so a blob of a restarted
    process (even one that got the same pid and port) is told from its predecessor's, and a
    blob server counts its connections by the requester it names. Made anew in a forked
    child: the workers a fork server forks each have their own, not the server's."""
    return _INCARNATION


def _forked() -> None:
    global _INCARNATION
    _INCARNATION = _new_incarnation()


os.register_at_fork(after_in_child=_forked)


class Keyring:
    """The job keys this process holds (job id -> key). Thread-safe."""

    def __init__(self) -> None:
        self._keys: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def add(self, job: str, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"a job key is {KEY_BYTES} bytes, not {len(key)}")
        with self._lock:
            self._keys[job] = bytes(key)

    def get(self, job: str) -> bytes | None:
        with self._lock:
            return self._keys.get(job)

    def drop(self, job: str) -> None:
        with self._lock:
            self._keys.pop(job, None)


_KEYRING = Keyring()


def keyring() -> Keyring:
    """This process's keyring (what its blob server checks and its fetches sign with)."""
    return _KEYRING


def request_mac(key: bytes, server_nonce: str, request: dict) -> str:
    """The MAC of ``request`` (every field but ``mac`` and the frame's own ``tensors`` list,
    empty in a request) on the connection whose hello carried ``server_nonce``."""
    body = {k: v for k, v in request.items() if k not in ("mac", "tensors")}
    msg = b"digen-blob-request-v1\0" + server_nonce.encode() + b"\0" + canonical(body)
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def proof_mac(key: bytes, client_nonce: str, digest: str) -> str:
    """The server's proof that it holds the job's key, over the request's nonce and the
    answered blob's manifest digest."""
    msg = b"digen-blob-proof-v1\0" + client_nonce.encode() + b"\0" + digest.encode()
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def same(a: object, b: str) -> bool:
    """Constant-time equality of a peer's MAC ``a`` (any JSON value) and ours."""
    return isinstance(a, str) and hmac.compare_digest(a.encode(), b.encode())
