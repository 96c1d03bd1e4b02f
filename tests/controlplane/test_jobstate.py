"""Job state in Redis: role tags, TAG budgets, weight versions (LoRA syncs only the adapter)."""

from __future__ import annotations

import pytest
import torch

from digen.controlplane.jobstate import JobState, LoopState
from digen.controlplane.queue import TaskQueue
from digen.controlplane.redis_conn import connect, count_round_trips, embedded_url
from digen.core.events import Role


def test_tags_and_budget(redis_client):
    job = JobState(redis_client, "j1")
    assert job.tag("w") is None
    job.set_tag("w", Role.TRAINER, 2)
    assert job.tag("w") == (Role.TRAINER, 2)
    assert job.take_budget("w") and job.take_budget("w")
    assert not job.take_budget("w")
    assert job.tag("w") == (Role.TRAINER, 0)  # never below zero
    job.return_budget("w")
    assert job.tag("w") == (Role.TRAINER, 1)


def test_one_loop_per_worker(redis_client):
    """A worker that seemed to leave and rejoin gets a second loop; the newer one owns it."""
    job = JobState(redis_client, "j2")
    assert job.owns_loop("w", "old")  # nothing claimed yet
    job.claim_loop("w", "old")
    assert job.owns_loop("w", "old")
    job.claim_loop("w", "new")
    assert not job.owns_loop("w", "old") and job.owns_loop("w", "new")
    assert job.owns_loop("other", "old")  # per worker


def test_loop_state_reads_status_owner_and_tag(redis_client):
    job = JobState(redis_client, "j3")
    assert job.loop_state("w", "t") == LoopState(None, True, None)
    job.set_status("running")
    job.claim_loop("w", "t")
    job.set_tag("w", Role.ROLLOUT, 1)
    assert job.loop_state("w", "t") == LoopState("running", True, (Role.ROLLOUT, 1))
    job.claim_loop("w", "newer")
    assert job.loop_state("w", "t").owns_loop is False


@pytest.mark.parametrize(
    ("role", "queue"), [(Role.COLOCATED, "gen"), (Role.ROLLOUT, "gen"), (Role.TRAINER, "train")]
)
def test_a_worker_loop_cycle_takes_two_round_trips(redis_client, role, queue):
    """Counted on the wire (a counting connection around the real client): the top of a cycle
    (status, loop owner, tag) is one pipelined round trip, the lease one script call; the
    three separate reads it replaces were three round trips."""
    from digen.workers.context import WorkerContext, poll
    from digen.workers.loop import next_task

    counted = connect(embedded_url(redis_client))
    trips = count_round_trips(counted)
    job, tasks = JobState(counted, "cycle"), TaskQueue(counted, "cycle")
    job.set_status("running")
    job.claim_loop("w", "token")
    job.set_tag("w", role, 1)
    assert tasks.lease([queue], "w") is None  # Redis caches the lease script (as after a first cycle)
    tasks.put(queue, f"{queue}:0:0", {"n": 0})
    ctx = WorkerContext("w", "cpu", None, tasks, job, "cpu", round_trips=trips)  # type: ignore[arg-type]

    before = trips.count
    state = poll(ctx, "token")
    assert state is not None and state.tag == (role, 1)
    leased = next_task(ctx, *state.tag)
    assert leased is not None and leased.task_id == f"{queue}:0:0"
    assert trips.count - before == 2

    before = trips.count  # the reads a cycle made before they were pipelined
    assert job.status() == "running" and job.owns_loop("w", "token") and job.tag("w") == (role, 1)
    assert trips.count - before == 3
    counted.close()


def test_lora_weight_sync_moves_only_the_adapter(tiny_sd3):
    """A version travels trainer -> rollout as the trained tensors only: the adapter of a
    LoRA run (a fifth of the transformer's bytes or less), fetched whole and equal."""
    from digen.core import blobnames
    from digen.dataplane.auth import keyring, new_key
    from digen.dataplane.blobs import BlobServer, BlobStore
    from digen.dataplane.weights import fetch_version
    from digen.models import load_policy

    policy = load_policy(tiny_sd3, height=32, width=32)
    full = {k: v.detach() for k, v in policy.transformer.state_dict().items()}
    policy.enable_lora(4, 8)
    adapter = policy.trainable_state_dict()
    assert all("lora_" in k for k in adapter)
    sent = {}
    for name, tensors in (("full", full), ("lora", adapter)):
        keyring().add(name, new_key())  # this process stands for the job's processes
        store = BlobStore()
        store.put(blobnames.weights(name, 0), tensors)
        server = BlobServer(store)
        try:
            got = fetch_version([server.address], blobnames.weights(name, 0))
            assert all(torch.equal(got[k], tensors[k]) for k in tensors)
            sent[name] = server.bytes_sent
        finally:
            server.close()
    assert sent["lora"] == sum(v.numel() * v.element_size() for v in adapter.values())
    assert sent["lora"] < sent["full"] / 5


@pytest.mark.parametrize(
    ("role", "mode", "fsdp", "member"),
    [
        (Role.TRAINER, "disaggregated", False, True),
        (Role.ROLLOUT, "disaggregated", False, False),
        (Role.REWARD, "disaggregated", False, False),
        (Role.COLOCATED, "colocated", False, True),
        (Role.ROLLOUT, "colocated", False, True),  # a worker loop's own view: its resource, any mode
        (Role.REWARD, "colocated", False, False),
        (Role.TRAINER, "disaggregated", True, False),  # FSDP ranks hold shards, not a replica
        (Role.COLOCATED, "colocated", True, False),
    ],
)
def test_who_holds_the_optimizer(role: Role, mode: str, fsdp: bool, member: bool):
    from digen.controlplane.trainer_group import holds_optimizer

    assert holds_optimizer(role, mode, fsdp) is member
