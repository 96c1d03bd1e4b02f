"""The trainer group's step command in Redis (real embedded Redis): it survives the round trip
whole, and junk written to ``tg:step`` is a PayloadError when a member reads it (the worker loop
quarantines it, digen/workers/loop.py), never a TypeError that ends the member's loop."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from digen.controlplane.messages import BlobRef, TaskBlob
from digen.controlplane.queue import TaskQueue, quarantined_count
from digen.controlplane.trainer_group import StepCommand, TrainerGroup
from digen.errors import PayloadError

MEMBERS = ["trainer-0", "trainer-1"]
FULL = StepCommand(
    "step:3:1",
    3,
    2,
    MEMBERS,
    5,
    32,
    held={"trainer-0": ["train:3:0"], "trainer-1": ["train:3:1"]},
    blobs=[TaskBlob("train:3:2", BlobRef("127.0.0.1:9001", "j:grad:train:3:2", "ab12"))],
    exact=True,
    writer="trainer-0",
    checkpoint="/runs/x/checkpoints/iter_0003",
    mini_batch=1,
    last_of_iteration=False,
    keep_version=4,
    serve_from=3,
    restore=None,
    incarnations={"trainer-0": "a", "trainer-1": "b"},
    asked_again=1,
)


def test_a_step_command_survives_redis_whole(redis_client):
    group = TrainerGroup(redis_client, "tgjob")
    group.set_step(FULL)
    back = group.step()
    assert back == FULL
    assert back.tasks() == ["train:3:0", "train:3:1", "train:3:2"]


def test_asking_again_is_a_new_mark_for_the_same_step(redis_client):
    """The controller asks again for an acknowledgement that did not read: the same step id
    and epoch under a new mark, which every member's loop reads as new work."""
    group = TrainerGroup(redis_client, "tgjob")
    again = replace(FULL, asked_again=FULL.asked_again + 1)
    assert (FULL.mark, again.mark) == ("step:3:1@2/trainer-0#1", "step:3:1@2/trainer-0#2")
    group.set_step(again)
    assert redis_client.get("digen:tgjob:tg:step:mark") == again.mark.encode()
    assert group.step() == again


def good() -> dict:
    return json.loads(FULL.dumps())


def with_(**changes) -> dict:
    d = good()
    d.update(changes)
    return d


@pytest.mark.parametrize(
    "raw, fault",
    [
        (b"\x80\x04\x95junk", "not JSON"),
        (b"[1, 2, 3]", "is a map, got list"),
        (json.dumps({k: v for k, v in good().items() if k != "members"}), "missing key.*members"),
        (json.dumps(with_(version="five")), "version: expected an integer, got str"),
        (json.dumps(with_(version=5.5)), "version: expected an integer, got float"),
        (json.dumps(with_(rows=True)), "rows: expected an integer, got bool"),
        (json.dumps(with_(stray=1)), "unknown key.*'stray'"),
        (json.dumps(with_(id="x" * (2 << 20))), "more than the limit"),
        ("[" * 100_000 + "]" * 100_000, "not JSON"),
        (json.dumps(with_(exact="yes")), "expected true or false"),
        (json.dumps(with_(held={"trainer-0": "train:3:0"})), "expected a list, got str"),
        (json.dumps(with_(held=[["trainer-0", ["train:3:0"]]])), "expected a map, got list"),
        (json.dumps(with_(blobs=[["train:3:2", "127.0.0.1:9001"]])), "blobs\\[0\\]: expected a map"),
        (json.dumps(with_(blobs=[{"task": "train:3:2", "blob": {"addr": "a"}}])), "missing key.*name"),
        (json.dumps(with_(held={"mallory": ["train:3:0"]})), "not its members"),
        (json.dumps(with_(writer="mallory")), "not its members"),
    ],
)
def test_junk_in_tg_step_is_a_payload_error(redis_client, raw, fault):
    group = TrainerGroup(redis_client, "tgjob")
    redis_client.set(group.step_key(), raw)
    with pytest.raises(PayloadError, match=fault):
        group.step()


def test_junk_a_member_read_is_quarantined_and_counted(redis_client):
    """What the worker loop does with a step command that does not read: the queue's junk
    record names the key and the reason, and ``digen status``'s count goes up."""
    group, queue = TrainerGroup(redis_client, "tgjob2"), TaskQueue(redis_client, "tgjob2")
    redis_client.set(group.step_key(), b"not json")
    with pytest.raises(PayloadError) as err:
        group.step()
    queue.quarantine("tg:step", redis_client.get(group.step_key()), str(err.value))
    assert quarantined_count(redis_client, "tgjob2") == 1
    (record,) = queue.quarantined()
    assert record["from"] == "digen:tgjob2:tg:step" and "not JSON" in record["reason"]
