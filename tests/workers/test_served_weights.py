"""The weights a replicated trainer serves (:func:`digen.workers.trainer.serve_weights`): one
host copy and one hashing per version, however many rollouts fetch it, and the bytes of that
version after the store has stepped past it.

The copy from CUDA runs on a side stream that waits for the step (:func:`digen.dataplane.wire.
copy_stream`); no GPU here, so torch's stream classes are replaced by recorders to check what
it asks of them, and the host path is checked to touch nothing of CUDA.
"""

from __future__ import annotations

import pytest
import torch

from digen.config import TrainConfig
from digen.core import blobnames
from digen.dataplane import blobs as blob_module
from digen.dataplane.auth import keyring, new_key
from digen.dataplane.blobs import BlobServer, BlobStore, fetch
from digen.dataplane.weights import fetch_version
from digen.dataplane.wire import copy_stream, host_copy
from digen.optim import ParameterStore
from digen.workers.trainer import serve_weights

JOB = "servejob"


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"block{i}.lora_A": torch.randn(16, 8, generator=g) for i in range(4)}


def _grads(store: ParameterStore, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(p.shape, generator=g) for k, p in store.params.items()}


@pytest.fixture()
def served(monkeypatch):
    """A store at version 1, a blob server over an empty store, and the counts of host copies
    and of hashings (every blob's manifest is made by ``tensor_digests``)."""
    counts = {"copies": 0, "hashed": 0}
    digests = blob_module.tensor_digests

    def counted(tensors, algorithm):
        counts["hashed"] += 1
        return digests(tensors, algorithm)

    monkeypatch.setattr(blob_module, "tensor_digests", counted)
    store = ParameterStore(_weights(), TrainConfig())
    store.step(_grads(store, 1), rows=2)
    blobs = BlobStore()
    keyring().add(JOB, new_key())
    server = BlobServer(blobs)
    yield store, blobs, server, counts
    server.close()
    keyring().drop(JOB)


def _version(store: ParameterStore, counts: dict[str, int]):
    def make() -> dict[str, torch.Tensor]:
        counts["copies"] += 1
        return store.weights_copy(lambda w: host_copy(w, torch.bfloat16))

    return make


def test_a_version_is_copied_and_hashed_once_and_keeps_its_bytes_after_the_step(served):
    store, blobs, server, counts = served
    want = {k: t.to(torch.bfloat16) for k, t in store.weights().items()}
    serve_weights(blobs, JOB, {1: _version(store, counts)})
    serve_weights(blobs, JOB, {1: _version(store, counts)})  # served again (a restarted serve): kept as is
    name = blobnames.weights(JOB, 1)
    for _ in range(3):  # three rollout workers, each in buckets
        got = fetch_version([server.address], name, bucket_bytes=512)
        assert list(got) == list(want) and [k for k in want if not torch.equal(got[k], want[k])] == []
    assert counts == {"copies": 1, "hashed": 1}

    store.step(_grads(store, 2), rows=2)
    now = store.weights()
    assert [k for k in want if torch.equal(now[k].to(torch.bfloat16), want[k])] == [], "nothing moved"
    got, meta = fetch(server.address, name)  # checked against the digest made at version 1
    assert meta["version"] == "1" and all(torch.equal(got[k], want[k]) for k in want)

    serve_weights(blobs, JOB, {2: _version(store, counts)}, keep_from=1)
    assert sorted(blobs.names()) == [blobnames.weights(JOB, 1), blobnames.weights(JOB, 2)]
    got2 = fetch_version([server.address], blobnames.weights(JOB, 2))
    assert all(torch.equal(got2[k], now[k].to(torch.bfloat16)) for k in now)
    assert counts == {"copies": 2, "hashed": 2}
    serve_weights(blobs, JOB, {2: _version(store, counts)})  # no keep_from: version 1 goes
    assert blobs.names() == [blobnames.weights(JOB, 2)]


def test_weights_copy_hands_the_live_tensors_once_under_the_lock():
    """The copy function gets the store's own tensors (no clone on the store's device first)
    and runs holding the step lock."""
    store = ParameterStore(_weights(), TrainConfig())
    seen = {}

    def copy(w):
        seen["locked"] = store.lock.locked()
        seen["shared"] = all(w[k].data_ptr() == store.params[k].data_ptr() for k in store.names)
        return host_copy(w)

    out = store.weights_copy(copy)
    assert seen == {"locked": True, "shared": True}
    assert list(out) == list(store.weights())
    assert all(out[k].data_ptr() != store.params[k].data_ptr() for k in store.names)


class _Stream:
    """Records what a host copy asks of a CUDA stream."""

    made: list[_Stream] = []

    def __init__(self, device=None):
        self.device, self.waited = device, []
        _Stream.made.append(self)

    def wait_stream(self, other) -> None:
        self.waited.append(other)


def test_a_copy_from_cuda_runs_on_a_side_stream_that_waits_for_the_current_one(monkeypatch):
    _Stream.made = []
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("current", device))
    dev = torch.device("cuda", 3)
    side = copy_stream(dev)
    assert _Stream.made == [side] and side.device == dev
    assert side.waited == [("current", dev)]  # the step's kernels on the device's current stream first
    assert copy_stream(torch.device("cpu")) is None and len(_Stream.made) == 1


def test_a_host_copy_of_host_tensors_touches_nothing_of_cuda(monkeypatch):
    def refused(*a, **k):
        raise AssertionError("a host copy of host tensors asked CUDA")

    for attr in ("Stream", "current_stream", "stream", "is_available", "current_device"):
        monkeypatch.setattr(torch.cuda, attr, refused)
    live = {"w": torch.arange(6, dtype=torch.float32)}
    got = host_copy(live, torch.bfloat16)
    assert got["w"].dtype == torch.bfloat16 and torch.equal(got["w"].float(), live["w"])
