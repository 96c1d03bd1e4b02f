"""A version from the trainers that hold it: bucketed, cast on the way, spread over holders,
and still whole when a holder is gone."""

from __future__ import annotations

import pytest
import torch

from digen.core import blobnames
from digen.dataplane.blobs import BlobLost, BlobServer, BlobStore
from digen.dataplane.weights import fetch_version


def weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {f"layer{i}.w": torch.randn(256, generator=g) for i in range(8)}


@pytest.fixture()
def holders():
    servers = []
    for _ in range(2):
        store = BlobStore()
        store.put(blobnames.weights("job", 3), weights())
        servers.append(BlobServer(store))
    yield servers
    for s in servers:
        s.close()


def test_a_version_comes_whole_in_buckets_spread_over_its_holders(holders):
    got = fetch_version([s.address for s in holders], blobnames.weights("job", 3), bucket_bytes=2048)
    want = weights()
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
    sent = [s.bytes_sent for s in holders]
    assert sum(sent) == 8 * 256 * 4 and min(sent) > 0  # 4 buckets of 2 tensors, each holder served some


def test_buckets_land_one_by_one_in_the_receivers_dtype(holders):
    landed: list[list[str]] = []
    out = fetch_version(
        [holders[0].address],
        blobnames.weights("job", 3),
        dtype=torch.bfloat16,
        bucket_bytes=1024,
        on_bucket=lambda b: landed.append(sorted(b)),
    )
    assert out == {}
    assert [n for b in landed for n in b] == sorted(weights())
    assert len(landed) == 4  # 512-byte bf16 tensors, two to a bucket
    assert holders[0].bytes_sent == 8 * 256 * 2


def test_a_gone_holder_is_replaced_by_the_next_and_no_holder_at_all_is_blob_lost(holders):
    addrs = [s.address for s in holders]
    holders[0].close()
    got = fetch_version(addrs, blobnames.weights("job", 3), bucket_bytes=2048)
    assert torch.equal(got["layer7.w"], weights()["layer7.w"])
    holders[1].close()
    with pytest.raises(BlobLost, match="no holder answered"):
        fetch_version(addrs, blobnames.weights("job", 3))
    with pytest.raises(BlobLost, match="no worker holds it"):
        fetch_version([], blobnames.weights("job", 3))
