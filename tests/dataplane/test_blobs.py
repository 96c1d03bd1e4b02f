"""The blob server: tensors go from the process that made them to the one that needs them,
whole or in parts, cast on the way when asked; a lost blob or a gone server is a BlobLost."""

from __future__ import annotations

import socket
import struct

import pytest
import torch

from digen.dataplane.blobs import (
    BlobLost,
    BlobServer,
    BlobStore,
    buckets,
    connection,
    describe,
    fetch,
    tls_contexts,
)
from digen.dataplane.wire import MAGIC, send_frame
from tests.reliability.certs import make_certs


@pytest.fixture()
def served():
    store = BlobStore()
    server = BlobServer(store)
    yield store, server
    server.close()


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(3, 4, generator=g),
        "b": torch.randn(5, generator=g, dtype=torch.float64),
        "c": torch.arange(6, dtype=torch.uint8).reshape(2, 3),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 7),
        "half": torch.randn(4, generator=g).to(torch.bfloat16),
    }


def test_a_fetched_blob_is_the_tensors_and_metadata_that_were_put(served):
    store, server = served
    store.put("job:gen:0:1", tensors(), {"version": "3"})
    got, meta = fetch(server.address, "job:gen:0:1")
    want = tensors()
    assert list(got) == list(want) and meta == {"version": "3"}
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


def test_a_fetch_of_some_tensors_cast_to_another_dtype_casts_only_floats(served):
    store, server = served
    store.put("w", tensors())
    got, _ = fetch(server.address, "w", names=["c", "a"], dtype=torch.bfloat16)
    assert list(got) == ["c", "a"]
    assert torch.equal(got["c"], tensors()["c"])  # integers travel as they are
    assert got["a"].dtype == torch.bfloat16 and torch.equal(got["a"], tensors()["a"].to(torch.bfloat16))


def test_one_connection_serves_many_requests(served):
    store, server = served
    store.put("x", {"t": torch.ones(3)})
    store.put("y", {"t": torch.zeros(2)})
    with connection(server.address) as s:
        assert torch.equal(fetch(server.address, "x", sock=s)[0]["t"], torch.ones(3))
        assert torch.equal(fetch(server.address, "y", sock=s)[0]["t"], torch.zeros(2))
    assert server.bytes_sent == 3 * 4 + 2 * 4


def test_a_missing_blob_a_missing_tensor_and_a_gone_server_are_blob_lost(served):
    store, server = served
    store.put("x", {"t": torch.ones(3)})
    with pytest.raises(BlobLost, match="no blob nope"):
        fetch(server.address, "nope")
    with pytest.raises(BlobLost, match="has no tensor u"):
        fetch(server.address, "x", names=["u"])
    store.drop("x")
    with pytest.raises(BlobLost, match="no blob x"):
        fetch(server.address, "x")
    address = server.address
    server.close()
    with pytest.raises(BlobLost, match="unreachable"):
        fetch(address, "x")


def test_describe_gives_shapes_without_bytes_and_buckets_split_by_travelling_size(served):
    store, server = served
    store.put(
        "w", {"a": torch.zeros(256), "b": torch.zeros(256), "c": torch.zeros(1024), "d": torch.zeros(8)}
    )
    specs, _ = describe(server.address, "w")
    assert [(s["name"], s["shape"], s["dtype"]) for s in specs] == [
        ("a", [256], "float32"),
        ("b", [256], "float32"),
        ("c", [1024], "float32"),
        ("d", [8], "float32"),
    ]
    assert server.bytes_sent == 0
    assert buckets(specs, 2048) == [["a", "b"], ["c"], ["d"]]
    assert buckets(specs, 4096) == [["a", "b"], ["c"], ["d"]]
    assert buckets(specs, 4096, dtype=torch.bfloat16) == [["a", "b", "c", "d"]]  # half the bytes


def until_closed(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (the hello, then its answer)."""
    got = b""
    try:
        while chunk := s.recv(65536):
            got += chunk
    except ConnectionResetError:
        pass
    return got


def test_junk_and_oversized_requests_are_refused_without_harm(served):
    store, server = served
    store.put("x", {"t": torch.ones(2)})
    host, port = server.address.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as s:  # not a frame at all
        s.sendall(b"\x80\x04\x95pickle-ish bytes")
        assert b'"error": "bad"' in until_closed(s)
    with socket.create_connection((host, int(port))) as s:  # a header claiming 1 GiB
        s.sendall(MAGIC + struct.pack("<Q", 2**30))
        assert b"over the" in until_closed(s)
    with socket.create_connection((host, int(port))) as s:  # an unknown op gets an answer
        send_frame(s, {"op": "exec", "blob": "x"})
        assert b"unknown request op exec" in until_closed(s)
    assert torch.equal(fetch(server.address, "x")[0]["t"], torch.ones(2))  # still serving
    assert server.counts["bad"] == 3 and server.counts["served"] == 1


def test_mutual_tls_serves_peers_with_a_signed_certificate_and_refuses_others(tmp_path):
    certs = make_certs(tmp_path / "certs")
    server_ctx, client_ctx = tls_contexts(str(certs.ca), str(certs.cert), str(certs.key))
    store = BlobStore()
    store.put("x", {"t": torch.arange(4.0)})
    server = BlobServer(store, ssl_context=server_ctx, handshake_s=0.5)  # a plain client sends no TLS hello
    try:
        with connection(server.address, client_ctx) as s:
            assert torch.equal(fetch(server.address, "x", sock=s)[0]["t"], torch.arange(4.0))
        with pytest.raises(BlobLost):  # a plain TCP client gets nothing
            fetch(server.address, "x")
    finally:
        server.close()


def test_a_fetch_can_leave_tensors_out(served):
    store, server = served
    store.put("g", tensors())
    got, _ = fetch(server.address, "g", exclude=("half", "c"))
    assert list(got) == ["a", "b", "scalar", "empty"]
