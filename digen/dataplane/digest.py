"""What a blob's bytes are: a digest of each tensor, and of the blob's manifest.

A tensor's digest is two-level: the bytes cut in :data:`CHUNK` pieces, each piece hashed with
the blob's algorithm (:data:`ALGORITHM`: XXH3-128), then the byte count and the pieces'
digests hashed with SHA-256. The pieces are independent, so a producer hashes a large tensor
on several threads, and a consumer hashes each piece as soon as it has landed, while the next
one is still on the wire (:class:`Receiver`): only the last piece's hash is left after the
transfer.

A blob's *manifest* is its identity (job, name, version, producer incarnation), its string
metadata, the algorithm and every tensor's name, dtype, shape and digest; the blob's digest is
the SHA-256 of the manifest's canonical JSON. The producer publishes that digest with the
blob's address (the control plane, trusted); a consumer recomputes it from the manifest the
server sends and checks each tensor against the manifest, so a byte that differs anywhere
fails the fetch.

Why XXH3-128 for the bytes and not SHA-256: the answer's manifest is authenticated with the
job's key (:mod:`digen.dataplane.auth`: a process without the key cannot answer at all), and
across hosts the link is TLS, which has its own integrity. What is left for the tensor digest
is to bind the bytes to that manifest against accidents: a stale or re-made blob, a torn or
corrupted transfer, a bug. A 128-bit non-cryptographic hash does that; it does *not* stop
someone who can change bytes on a plain-TCP link (``--insecure`` across hosts), who could
match it on purpose, as they could read everything anyway. Measured at FLUX LoRA r64 size
(``digen bench --dataplane``): SHA-256 cost 40% of the transfer on the bench machine, XXH3-128
under 1%; the budget is 5%. A process without the ``xxhash`` package falls back to SHA-256
(the manifest names the algorithm, and the consumer uses the one it names).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from digen.dataplane.auth import canonical


def _sha256(data: memoryview) -> bytes:
    return hashlib.sha256(data).digest()


ALGORITHMS: dict[str, Callable[[memoryview], bytes]] = {"sha256": _sha256}
try:
    import xxhash

    def _xxh3_128(data: memoryview) -> bytes:
        return xxhash.xxh3_128(data).digest()

    ALGORITHMS["xxh3-128"] = _xxh3_128
except ImportError:  # an install without it hashes with SHA-256 (slower; see the docstring)
    pass

CHUNK = 8 * 2**20
"""Bytes per hashed piece: large enough that a piece's hash costs far more than its call,
small enough that the hash left after the last byte lands is a few milliseconds."""
THREADS = 4
"""Threads hashing a producer's pieces (and a consumer's, behind the socket)."""
ALGORITHM = "xxh3-128" if "xxh3-128" in ALGORITHMS else "sha256"
"""The algorithm this process hashes its blobs' pieces with (named in each manifest)."""

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


def hasher(algorithm: str) -> Callable[[memoryview], bytes]:
    """The piece hash named ``algorithm`` (:class:`KeyError` when this process has none such)."""
    return ALGORITHMS[algorithm]


def _combine(algorithm: str, n: int, pieces: list[bytes]) -> str:
    top = hashlib.sha256(f"digen-tensor-v1\0{algorithm}\0".encode() + n.to_bytes(8, "little"))
    for p in pieces:
        top.update(p)
    return top.hexdigest()


def tensor_digest(t: torch.Tensor, algorithm: str = ALGORITHM) -> str:
    """The digest of ``t``'s bytes (moved to the CPU and made contiguous first)."""
    return tensor_digests({"t": t}, algorithm)["t"]


def tensor_digests(tensors: dict[str, torch.Tensor], algorithm: str = ALGORITHM) -> dict[str, str]:
    """Every tensor's digest, the pieces of all of them hashed on the pool at once (a blob of
    many small tensors keeps the threads as busy as one large tensor)."""
    fn = hasher(algorithm)
    cpu = {n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}
    jobs: dict[str, tuple[int, list[Future[bytes]]]] = {}
    for n, t in cpu.items():
        data = raw_bytes(t)
        views = [data[i : i + CHUNK] for i in range(0, len(data), CHUNK)]
        jobs[n] = (len(data), [pool().submit(fn, v) for v in views])
    return {n: _combine(algorithm, size, [f.result() for f in futs]) for n, (size, futs) in jobs.items()}


def manifest_digest(manifest: dict[str, Any]) -> str:
    return hashlib.sha256(b"digen-manifest-v1\0" + canonical(manifest)).hexdigest()


class Receiver:
    """Hashes a tensor piece by piece as a socket fills it: :meth:`landed` after each read
    (it hashes every whole piece that is now complete, on the pool), :meth:`digest` at the end."""

    def __init__(self, data: memoryview, algorithm: str = ALGORITHM):
        self.data = data
        self.algorithm = algorithm
        self.fn = hasher(algorithm)
        self.done = 0
        self.futures: list[Future[bytes]] = []

    def landed(self, upto: int) -> None:
        while self.done + CHUNK <= upto:
            self.futures.append(pool().submit(self.fn, self.data[self.done : self.done + CHUNK]))
            self.done += CHUNK

    def digest(self) -> str:
        if self.done < len(self.data):
            self.futures.append(pool().submit(self.fn, self.data[self.done :]))
            self.done = len(self.data)
        return _combine(self.algorithm, len(self.data), [f.result() for f in self.futures])
