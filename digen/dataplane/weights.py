"""A policy version from the trainers that hold it to a worker that needs it: bucketed, cast
to the dtype the receiver computes in, each bucket from another holder.

Every trainer holds the newest version (and, with staleness 1, the one before) as a blob
``weights:<version>`` in its :class:`~digen.dataplane.blobs.BlobStore`. A rollout worker that
needs version v asks the holders Redis lists (:mod:`digen.controlplane.trainer_group`) for the
tensor list once, cuts it into buckets of about ``bucket_bytes``, and fetches bucket i from
holder ``(i + start) mod H`` on its own connection, a few buckets in flight at once, so N
rollout workers pulling a version spread over every trainer's link. A bucket whose holder
fails is fetched from the next one; only when every holder failed is the version lost.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from digen.dataplane.blobs import BlobLost, BlobMismatch, Expect, buckets, describe, fetch

log = logging.getLogger(__name__)

BUCKET_BYTES = 64 * 2**20
"""Default bucket size: large enough to keep a link busy, small enough to overlap the load of
one bucket with the transfer of the next."""
IN_FLIGHT = 4


def fetch_version(
    holders: list[str],
    name: str,
    *,
    dtype: torch.dtype | None = None,
    bucket_bytes: int = BUCKET_BYTES,
    start: int = 0,
    on_bucket: Callable[[dict[str, torch.Tensor]], None] | None = None,
    version: int | None = None,
) -> dict[str, torch.Tensor]:
    """Blob ``name`` (a version's weights) from ``holders`` (blob server addresses), bucket by
    bucket. ``on_bucket(tensors)`` receives each bucket as it lands (then nothing is kept and
    ``{}`` returns); else the whole dict returns. ``start`` offsets which holder serves the
    first bucket (spread receivers: their index). Raises :class:`BlobLost` when no holder can
    serve some bucket. ``version``: the version the blob must say it is. A holder whose
    answer does not check out (:class:`~digen.dataplane.blobs.BlobMismatch`: another version,
    no proof of the job's key) serves no further bucket: one warning, not one per bucket."""
    expect = Expect(version=version)
    bad: set[str] = set()
    if not holders:
        raise BlobLost(f"{name}: no worker holds it")
    specs = None
    errors = []
    for h in holders[start % len(holders) :] + holders[: start % len(holders)]:
        try:
            specs, _ = describe(h, name, expect=expect)
            break
        except BlobMismatch as exc:
            bad.add(h)
            errors.append(str(exc))
        except BlobLost as exc:
            errors.append(str(exc))
    if specs is None:
        raise BlobLost(f"{name}: no holder answered ({'; '.join(errors)})")
    parts = buckets(specs, bucket_bytes, dtype)
    out: dict[str, torch.Tensor] = {}

    def one(i: int) -> dict[str, torch.Tensor]:
        tried = []
        for j in range(len(holders)):
            h = holders[(start + i + j) % len(holders)]
            if h in bad:
                continue
            try:
                return fetch(h, name, names=parts[i], dtype=dtype, expect=expect)[0]
            except BlobMismatch as exc:
                bad.add(h)
                tried.append(str(exc))
            except BlobLost as exc:
                tried.append(str(exc))
        raise BlobLost(f"{name} bucket {i}: every holder failed ({'; '.join(tried)})")

    with ThreadPoolExecutor(max_workers=min(IN_FLIGHT, len(parts)), thread_name_prefix="digen-fetch") as pool:
        for got in pool.map(one, range(len(parts))):
            if on_bucket is not None:
                on_bucket(got)
            else:
                out.update(got)
    return out
