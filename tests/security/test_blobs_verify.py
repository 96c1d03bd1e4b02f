"""Verified tensors: a consumer checks every answer against the job's key, the digest and
version the control plane published, and each tensor's bytes; what fails is a lost blob with
one warning naming its producer. A gradient not shaped as the trained tensors is refused."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from types import SimpleNamespace

import pytest
import torch

from digen.controlplane.messages import BlobRef
from digen.core import blobnames
from digen.dataplane.auth import keyring, new_key, proof_mac
from digen.dataplane.blobs import Blob, BlobLost, BlobMismatch, BlobStore, Expect, fetch
from digen.dataplane.digest import ALGORITHMS
from digen.dataplane.reduce import GradientMismatch, TaskSum, ordered_sum
from digen.dataplane.weights import fetch_version
from digen.dataplane.wire import recv_header, send_frame
from digen.workers.tasks import group_tensors, park
from tests.security.blob_helpers import JOB, job_key, serving, until_closed, weights

TRAJ = f"{JOB}:traj:gen:1:0"


def mismatches(caplog) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name == "digen.dataplane.blobs" and "not what was published" in r.message
    ]


def trajectories(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"latents": torch.randn(2, 3, 8, generator=g), "log_probs": torch.randn(2, 3, generator=g)}


def train_task(addr: str, digest: str, version: int) -> tuple[SimpleNamespace, BlobRef]:
    """A leased train task and its payload's source as the controller posts them: where its
    group is, its digest, its version."""
    return SimpleNamespace(task_id="train:1:0"), BlobRef(addr, TRAJ, digest, version)


def consumer(addr: str = "") -> SimpleNamespace:
    """What :func:`group_tensors` reads of a worker: its name, job, store and address."""
    return SimpleNamespace(
        name="trainer-0", job=SimpleNamespace(job_id=JOB), blobs=BlobStore(), blob_addr=addr
    )


class Impostor:
    """A process that took over a dead producer's port: it speaks the protocol, answers any
    request (it cannot check the MAC: it has no key) with its own blob under the asked name,
    and signs its answer with a key it made up."""

    def __init__(self, blob: Blob):
        self.blob = blob
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            send_frame(conn, {"hello": "digen-blob/2", "nonce": "0" * 32})
            req = recv_header(conn)
            proof = proof_mac(new_key(), req["nonce"], self.blob.digest)
            head = {
                "ok": True,
                "meta": self.blob.meta,
                "manifest": self.blob.manifest,
                "digest": self.blob.digest,
            }
            with contextlib.suppress(OSError):  # the consumer hangs up after the header
                send_frame(conn, head | {"proof": proof}, self.blob.tensors)
                until_closed(conn)
        self.sock.close()


def test_a_taken_over_port_serving_another_blob_under_the_same_name_is_a_lost_blob(caplog):
    """The producer published its group's digest and died; the process now at its port (no
    key of the job) serves other tensors under the same name: no proof of the key, a lost blob."""
    caplog.set_level(logging.WARNING, "digen.dataplane.blobs")
    with job_key():
        genuine = BlobStore(producer="rollout-0@a").put(TRAJ, trajectories(0), {"version": "1"})
        impostor = Impostor(BlobStore(producer="intruder@b").put(TRAJ, trajectories(1), {"version": "1"}))
        with pytest.raises(BlobMismatch, match=r"producer intruder@b.*no proof of the job's key"):
            group_tensors(consumer(), *train_task(impostor.address, genuine.digest, 1), None)
        impostor.thread.join(5)
    assert len(mismatches(caplog)) == 1 and "intruder@b" in mismatches(caplog)[0].message


def test_a_job_process_serving_another_blob_under_the_name_is_caught_by_the_published_digest(caplog):
    """A generation task that ran again (its first result was counted) holds another group
    under the same name: the digest the controller published tells them apart."""
    caplog.set_level(logging.WARNING, "digen.dataplane.blobs")
    with job_key():
        with serving(BlobStore(producer="rollout-0@a")) as (first, counted_at):
            counted = first.put(TRAJ, trajectories(0), {"version": "1"})
            with serving(BlobStore(producer="rollout-1@c")) as (store, server):
                store.put(TRAJ, trajectories(0), {"version": "1"})  # the same tensors, made again elsewhere:
                with pytest.raises(BlobLost, match="digest differs"):  # another incarnation, another blob
                    group_tensors(consumer(), *train_task(server.address, counted.digest, 1), None)
            got = group_tensors(consumer(), *train_task(counted_at.address, counted.digest, 1), None)
    assert torch.equal(got["latents"], trajectories(0)["latents"])
    assert len(mismatches(caplog)) == 1 and "rollout-1@c" in mismatches(caplog)[0].message


def test_a_blob_of_the_wrong_version_is_lost_and_fetch_version_skips_its_holder(caplog):
    caplog.set_level(logging.WARNING, "digen.dataplane.blobs")
    with job_key():
        with serving() as (old, stale), serving() as (new, good):
            old.put(blobnames.weights(JOB, 3), weights(0), {"version": "2"})  # says it is version 2
            new.put(blobnames.weights(JOB, 3), weights(1), {"version": "3"})
            with pytest.raises(BlobMismatch, match="version 2, not 3"):
                fetch(stale.address, blobnames.weights(JOB, 3), expect=Expect(version=3))
            caplog.clear()
            got = fetch_version(
                [stale.address, good.address], blobnames.weights(JOB, 3), version=3, bucket_bytes=1024
            )
            assert list(got) == list(weights(1)) and all(torch.equal(got[k], weights(1)[k]) for k in got)
            assert len(mismatches(caplog)) == 1  # the stale holder was asked once, then skipped
            assert good.counts["served"] == 2 and stale.counts["served"] == 1  # 2 buckets; the fetch above
            with pytest.raises(BlobLost, match="no holder answered"):
                fetch_version([stale.address], blobnames.weights(JOB, 3), version=3)


def test_bytes_that_differ_from_their_digest_are_a_lost_blob():
    """The manifest (and its proof) are genuine, the bytes that follow are not: each tensor is
    checked against its digest as it lands."""
    with job_key(), serving() as (store, server):
        blob = store.put(TRAJ, trajectories(0), {"version": "1"})
        digest = blob.digest  # published: the tensors are hashed now
        blob.tensors["log_probs"].add_(1.0)  # changed after it was hashed (a stand-in for a link)
        with pytest.raises(BlobMismatch, match="bytes of tensor log_probs differ"):
            fetch(server.address, TRAJ, expect=Expect(digest=digest))
        got, _ = fetch(server.address, TRAJ, names=["latents"], expect=Expect(digest=digest))
        assert torch.equal(got["latents"], trajectories(0)["latents"])  # the untouched tensor is fine


def test_a_cast_fetch_checks_names_shapes_and_the_manifest():
    with job_key(), serving() as (store, server):
        blob = store.put(blobnames.weights(JOB, 2), weights(), {"version": "2"})
        got, _ = fetch(
            server.address, blobnames.weights(JOB, 2), dtype=torch.bfloat16, expect=Expect(blob.digest, 2)
        )
        assert {k: (v.dtype, tuple(v.shape)) for k, v in got.items()} == {
            k: (torch.bfloat16, (8, 16)) for k in weights()
        }


def test_the_consumers_byte_limit_holds_before_anything_is_read():
    with job_key(), serving() as (store, server):
        store.put(TRAJ, trajectories(0))
        with pytest.raises(BlobLost, match="over the 100-byte limit"):
            fetch(server.address, TRAJ, max_bytes=100)


def grads(**tensors) -> dict[str, torch.Tensor]:
    base = {"a": torch.ones(3, 4), "b": torch.ones(5)}
    return {**base, **tensors}


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        (grads(a=torch.ones(1)), r"tensor a is torch.float32 \[1\]"),  # would broadcast into every row
        (grads(a=torch.ones(3, 4, dtype=torch.float64)), "tensor a is torch.float64"),
        ({"a": torch.ones(3, 4)}, "missing"),
        (grads(c=torch.ones(2)), "extra"),
    ],
)
def test_taskum_and_ordered_sum_refuse_a_gradient_not_shaped_as_the_trained_tensors(bad, why):
    like = grads()
    acc = TaskSum(like=like)
    acc.add("train:0:0", grads())
    with pytest.raises(GradientMismatch, match=why):
        acc.add("train:0:1", bad)
    assert acc.tasks == ["train:0:0"] and torch.equal(acc.total["a"], torch.ones(3, 4))  # unchanged
    unlike = TaskSum()  # no trained tensors given: the first gradient is the layout
    unlike.add("train:0:0", grads())
    with pytest.raises(GradientMismatch):
        unlike.add("train:0:1", bad)
    with pytest.raises(GradientMismatch, match=why):
        ordered_sum([grads(), bad], like=like)
    with pytest.raises(GradientMismatch):
        ordered_sum([grads(), bad])


def test_a_first_gradient_in_float64_is_refused_without_trained_tensors_to_compare():
    with pytest.raises(GradientMismatch, match="float64, not float32"):
        TaskSum().add("train:0:0", {"a": torch.ones(2, dtype=torch.float64)})
    with pytest.raises(GradientMismatch, match="float64, not float32"):
        ordered_sum([{"a": torch.ones(2, dtype=torch.float64)}])


def test_the_process_keyring_is_left_as_found():
    assert keyring().get(JOB) is None


def test_a_blob_hashed_with_sha256_is_checked_with_sha256_and_an_unknown_hash_is_refused(monkeypatch):
    """The manifest names its algorithm (a producer without the ``xxhash`` package hashes with
    SHA-256); the consumer hashes with the one named, and refuses one it does not know."""
    with job_key(), serving() as (store, server):
        monkeypatch.setattr("digen.dataplane.blobs.ALGORITHM", "sha256")
        blob = store.put(TRAJ, trajectories(0))
        assert blob.manifest["hash"] == "sha256"
        assert torch.equal(
            fetch(server.address, TRAJ, expect=Expect(blob.digest))[0]["latents"], blob.tensors["latents"]
        )
        blob.tensors["latents"].add_(1.0)
        with pytest.raises(BlobMismatch, match="bytes of tensor latents differ"):
            fetch(server.address, TRAJ)
        monkeypatch.setattr("digen.dataplane.blobs.ALGORITHM", "md4")
        monkeypatch.setitem(ALGORITHMS, "md4", lambda m: b"")
        assert store.put(TRAJ, trajectories(0)).manifest["hash"] == "md4"
        monkeypatch.delitem(ALGORITHMS, "md4")
        with pytest.raises(BlobMismatch, match="its digests use md4, unknown here"):
            fetch(server.address, TRAJ)


def test_a_mismatch_parks_the_task_with_one_warning_in_all(caplog):
    """The task that needed the blob is parked (its input is made again, as for a dead
    producer); the fetch's warning naming the producer is the only one."""
    caplog.set_level(logging.INFO)
    parked = []
    with job_key():
        genuine = BlobStore(producer="rollout-0@a").put(TRAJ, trajectories(0), {"version": "1"})
        with serving(BlobStore(producer="rollout-9@z")) as (store, server):
            store.put(TRAJ, trajectories(3), {"version": "1"})
            ctx = consumer()
            ctx.queue = SimpleNamespace(park=lambda task, worker, why: parked.append((task, worker, why)))
            leased, src = train_task(server.address, genuine.digest, 1)
            with pytest.raises(BlobMismatch) as err:
                group_tensors(ctx, leased, src, None)
            park(ctx, leased, err.value)
    assert parked == [("train:1:0", "trainer-0", f"BlobLost: {err.value}")]
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "rollout-9@z" in warnings[0].getMessage()
