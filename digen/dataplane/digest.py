"""What a blob's bytes are: a SHA-256 digest of each tensor, and of the blob's manifest.

A tensor's digest is a two-level SHA-256: the bytes cut in :data:`CHUNK` pieces, each piece
hashed, then the byte count and the pieces' digests hashed. The pieces are independent, so a
producer hashes a large tensor on several threads (``hashlib`` releases the GIL), and a
consumer hashes each piece as soon as it has landed, while the next one is still on the wire
(:class:`Receiver`): only the last piece's hash is left after the transfer.

A blob's *manifest* is its identity (job, name, version, producer incarnation), its string
metadata and every tensor's name, dtype, shape and digest; the blob's digest is the SHA-256 of
the manifest's canonical JSON. The producer publishes that digest with the blob's address
(the control plane, trusted); a consumer recomputes it from the manifest the server sends and
checks each tensor against the manifest, so a byte that differs anywhere fails the fetch.

Why SHA-256 and not a fast checksum: the request and the server's answer are authenticated
with the job's key (:mod:`digen.dataplane.auth`), which keeps a process without the key from
answering at all; the digest is what binds the *bytes* to what the producer published, also
where a link is plain TCP and someone on it could change bytes after the authenticated header.
Only a collision-resistant hash does that (a CRC or xxHash can be matched on purpose). With
SHA extensions (x86 SHA-NI, ARMv8) OpenSSL's SHA-256 is the fastest hash ``hashlib`` has,
faster than BLAKE2b; ``digen bench --dataplane`` measures both against the transfer.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from digen.dataplane.auth import canonical

CHUNK = 8 * 2**20
"""Bytes per hashed piece: large enough that a piece's hash costs far more than its call,
small enough that the hash left after the last byte lands is a few milliseconds."""
THREADS = 4
"""Threads hashing a producer's pieces (and a consumer's, behind the socket)."""
ALGORITHM = "sha256"

_POOL: ThreadPoolExecutor | None = None


def pool() -> ThreadPoolExecutor:
    """The process's hashing threads (started on first use)."""
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="digen-digest")
    return _POOL


def raw_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def _piece(data: memoryview) -> bytes:
    return hashlib.sha256(data).digest()


def _combine(n: int, pieces: list[bytes]) -> str:
    top = hashlib.sha256(b"digen-tensor-v1\0" + n.to_bytes(8, "little"))
    for p in pieces:
        top.update(p)
    return top.hexdigest()


def tensor_digest(t: torch.Tensor, *, threads: bool = True) -> str:
    """The digest of ``t``'s bytes (moved to the CPU and made contiguous first)."""
    data = raw_bytes(t.detach().to("cpu").contiguous())
    views = [data[i : i + CHUNK] for i in range(0, len(data), CHUNK)]
    if threads and len(views) > 1:
        pieces = list(pool().map(_piece, views))
    else:
        pieces = [_piece(v) for v in views]
    return _combine(len(data), pieces)


def tensor_digests(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """Every tensor's digest, the pieces of all of them hashed on the pool at once (a blob of
    many small tensors keeps the threads as busy as one large tensor)."""
    cpu = {n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}
    jobs: dict[str, tuple[int, list[Future[bytes]]]] = {}
    for n, t in cpu.items():
        data = raw_bytes(t)
        views = [data[i : i + CHUNK] for i in range(0, len(data), CHUNK)]
        jobs[n] = (len(data), [pool().submit(_piece, v) for v in views])
    return {n: _combine(size, [f.result() for f in futs]) for n, (size, futs) in jobs.items()}


def manifest_digest(manifest: dict[str, Any]) -> str:
    return hashlib.sha256(b"digen-manifest-v1\0" + canonical(manifest)).hexdigest()


class Receiver:
    """Hashes a tensor piece by piece as a socket fills it: :meth:`landed` after each read
    (it hashes every whole piece that is now complete, on the pool), :meth:`digest` at the end."""

    def __init__(self, data: memoryview):
        self.data = data
        self.done = 0
        self.futures: list[Future[bytes]] = []

    def landed(self, upto: int) -> None:
        while self.done + CHUNK <= upto:
            self.futures.append(pool().submit(_piece, self.data[self.done : self.done + CHUNK]))
            self.done += CHUNK

    def digest(self) -> str:
        if self.done < len(self.data):
            self.futures.append(pool().submit(_piece, self.data[self.done :]))
            self.done = len(self.data)
        return _combine(len(self.data), [f.result() for f in self.futures])
