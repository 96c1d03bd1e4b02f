"""What the workers send back (digen/controlplane/messages.py), and what the controller sends
(the payloads and the step command, read by the same exact reading): every message survives the
queue's round trip whole, and junk (a value of another kind, a key missing or unknown, bytes
that are not msgpack, a pickle, a map too large) is refused as a PayloadError naming the
message; the controller quarantines a stored result that does not read and runs its task
again (real embedded Redis), never a KeyError of its own."""

from __future__ import annotations

import json
import pickle
from dataclasses import replace
from pathlib import Path

import pytest

from digen.config import Config
from digen.controlplane import messages
from digen.controlplane.codec import pack
from digen.controlplane.jobstate import JobState
from digen.controlplane.messages import (
    PNG,
    BlobRef,
    EvalChunkResult,
    GenResult,
    Message,
    RewardResult,
    StepAck,
    TaskBlob,
    TrainResult,
    result_type,
)
from digen.controlplane.payloads import (
    EvalPayload,
    FsdpStepPayload,
    GenPayload,
    RewardPayload,
    StepPayload,
    TrainEntry,
    TrainPayload,
)
from digen.controlplane.queue import TaskQueue, quarantined_count
from digen.controlplane.trainer_group import StepCommand
from digen.core.timeline import TimelineRow
from digen.errors import PayloadError
from digen.evaluation import EvalTask
from digen.records import MAX_ITEMS, MAX_TEXT
from digen.rundir import RunDir
from digen.runtime.dispatch import Dispatcher
from digen.runtime.ledger import Ledger
from digen.runtime.results import Collector
from digen.task_records import GroupTask, TrainSpec, TrainStats
from tests.conftest import small_config_data

ROW = TimelineRow("rollout-0", "cpu", "rollout", "gen", 2, 1, 10.0, 12.5, cpu_s=1.5, batch=2, leased=9.5)
BLOB = BlobRef("127.0.0.1:9000", "j:traj:gen:2:1", "ab12", 1, worker="rollout-0", nbytes=4096)
CELLS = PNG + b"cells"
ENVELOPE = {"worker": "rollout-0", "start": 9.0, "end": 12.5, "events": [ROW], "incarnation": "a1"}

MESSAGES: list[Message] = [
    BLOB,
    TaskBlob("train:2:1", BLOB),
    GenResult(**ENVELOPE, blob=BLOB, rewards=[0.5, -1.0], reward_parts=[[0.1, 0.2]], cells=CELLS),
    GenResult(**ENVELOPE, blob=BLOB),
    RewardResult(**ENVELOPE, rewards=[0.5, 0.25], reward_parts=None),
    TrainResult(**ENVELOPE, stats=TrainStats(rows=8, loss=0.5, forwards=2), grad=BLOB),
    TrainResult(**ENVELOPE, stats=TrainStats()),
    EvalChunkResult(**ENVELOPE, scores={"reward": [0.5, 0.75], "clip": [0.1, 0.2]}, cells=CELLS),
    StepAck(**ENVELOPE, grad_norm=0.75, version=3, checkpoint="/runs/x/checkpoints/iter_0002"),
    StepCommand(
        "step:2",
        2,
        1,
        ["trainer-0"],
        2,
        16,
        held={"trainer-0": ["train:2:0"]},
        blobs=[TaskBlob("train:2:1", BLOB)],
        writer="trainer-0",
        incarnations={"trainer-0": "a1"},
    ),
]
SPEC = TrainSpec(
    iteration=2, group=1, gen_version=1, samples=[0, 1], sample_ids=[4, 5], advantages=[1.0, -1.0]
)
GROUP = GroupTask(iteration=2, group=1, prompt="a red square", sample_ids=(4, 5), version=1)
MESSAGES += [  # what the controller sends, read back by the same exact reading
    GenPayload(GROUP, score=False, grid=True),
    RewardPayload(GROUP, BLOB),
    TrainPayload(SPEC, 1, "a red square", tsp=True, source=BLOB, batch=(TrainEntry(SPEC, "b", None),)),
    EvalPayload(EvalTask(2, 1, 0, (0, 1), ("a", "b"))),
    StepPayload(2, 0),
    FsdpStepPayload(2, 0, True, 16, None, 1),
]
IDS = [f"{type(m).__name__}-{i}" for i, m in enumerate(MESSAGES)]


def wrong(value: object) -> object:
    """A value of another kind than ``value`` (None: a map no field of these messages takes)."""
    if isinstance(value, bool):
        return "yes"
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, str):
        return 7
    if isinstance(value, bytes):
        return "text"
    if isinstance(value, list):
        return {"a": 1}
    if isinstance(value, dict):
        return [1]
    return {"stray": 1}


@pytest.mark.parametrize("msg", MESSAGES, ids=IDS)
def test_every_message_survives_msgpack_and_the_queue_whole(msg: Message, redis_client):
    cls = type(msg)
    assert cls.read(msg.to_json()) == msg
    assert cls.read(pack(msg.to_json())) == msg  # raw bytes read through the same codec
    q = TaskQueue(redis_client, "msgs")
    q.put("gen", "gen:2:1", {"n": 1})
    assert q.lease(["gen"], "rollout-0") is not None
    assert q.ack("gen:2:1", msg.to_json(), worker="rollout-0")
    assert cls.read(q.get_result("gen:2:1")) == msg == cls.read(q.raw_result("gen:2:1"))


def test_a_timeline_row_writes_the_keys_of_timeline_jsonl_and_only_those_set():
    assert list(ROW.to_json()) == [
        *("worker", "gpu_type", "role", "kind", "iteration", "version", "start", "end"),
        *("cpu_s", "batch", "leased"),
    ]
    assert TimelineRow.read_exact(ROW.to_json()) == ROW
    with pytest.raises(TypeError, match="no key 'color'"):
        ROW.set(color="red")


@pytest.mark.parametrize("msg", MESSAGES, ids=IDS)
def test_a_value_of_another_kind_in_any_key_is_refused(msg: Message):
    good = msg.to_json()
    for key, value in good.items():
        with pytest.raises(PayloadError, match=f"a {type(msg).__name__} that does not read: .*{key}"):
            type(msg).read({**good, key: wrong(value)})


@pytest.mark.parametrize("msg", MESSAGES, ids=IDS)
def test_a_missing_key_or_an_unknown_one_is_refused(msg: Message):
    good, cls = msg.to_json(), type(msg)
    required = _required(cls)
    assert required, "every message has a key it cannot do without"
    for key in good:
        less = {k: v for k, v in good.items() if k != key}
        if key in required:
            with pytest.raises(PayloadError, match=rf"missing key\(s\) {key}"):
                cls.read(less)
        else:  # a key with a default may be left out: it reads as that default
            assert getattr(cls.read(less), key) == getattr(cls.read_exact(_defaults(cls, good)), key)
    with pytest.raises(PayloadError, match="unknown key.*'stray'"):
        cls.read({**good, "stray": 1})


def _defaults(cls: type, good: dict) -> dict:
    return {k: v for k, v in good.items() if k in _required(cls)}


def _required(cls: type) -> set[str]:
    from dataclasses import MISSING, fields

    return {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}


@pytest.mark.parametrize("cls", sorted({type(m) for m in MESSAGES}, key=lambda c: c.__name__))
@pytest.mark.parametrize(
    "raw, fault",
    [
        (b"\xc1 not msgpack", "not a msgpack payload"),
        (pickle.dumps({"worker": "w"}), "refusing a pickle"),
        (pack([1, 2, 3]), "expected a map, got list"),
        (pack("text"), "expected a map, got str"),
        (None, "expected a map, got NoneType"),
        (b"\x00" * ((1 << 20) + 1), "more than the limit of 1048576"),
    ],
    ids=["not-msgpack", "pickle", "list", "text", "none", "huge-bytes"],
)
def test_bytes_that_are_no_message_are_refused(cls: type[Message], raw, fault, monkeypatch):
    monkeypatch.setattr(messages, "MAX_MESSAGE_BYTES", 1 << 20)  # the limit's check, not its size
    with pytest.raises(PayloadError, match=fault):
        cls.read(raw)


def test_huge_values_inside_a_message_are_refused():
    good = MESSAGES[2].to_json()
    for key, junk in [
        ("worker", "w" * (MAX_TEXT + 1)),
        ("rewards", [0.0] * (MAX_ITEMS + 1)),
    ]:
        with pytest.raises(PayloadError, match="more than the limit"):
            GenResult.read({**good, key: junk})


def test_junk_inside_a_nested_record_is_refused_naming_where():
    good = MESSAGES[2].to_json()
    row = {**ROW.to_json(), "start": "soon"}
    with pytest.raises(PayloadError, match=r"GenResult.events\[0\].start: expected a number, got str"):
        GenResult.read({**good, "events": [row]})
    with pytest.raises(PayloadError, match=r"events\[0\]: unknown key.*'color'"):
        GenResult.read({**good, "events": [{**ROW.to_json(), "color": "red"}]})
    with pytest.raises(PayloadError, match=r"GenResult.blob: missing key.*name"):
        GenResult.read({**good, "blob": {"addr": "127.0.0.1:1"}})
    with pytest.raises(PayloadError, match="not a PNG"):
        GenResult.read({**good, "cells": b"GIF89a"})
    with pytest.raises(PayloadError, match="version: expected an integer, got bool"):
        StepAck.read({**MESSAGES[8].to_json(), "version": True})


def test_each_task_kind_reads_its_own_result():
    assert result_type("gen:1:0") is GenResult and result_type("train:1:0:1") is TrainResult
    assert result_type("reward:1:0") is RewardResult and result_type("eval:1:0") is EvalChunkResult
    assert result_type("step:1") is StepAck and result_type("step:1:0") is StepAck
    with pytest.raises(PayloadError, match="unknown key.*'stats'"):  # a train task's result as a gen's
        GenResult.read(MESSAGES[5].to_json())


# --- the controller ---------------------------------------------------------------------
def make_collector(redis_client, tmp_path: Path) -> Collector:
    cfg = Config.model_validate(small_config_data(str(tmp_path)))
    led = Ledger(cfg, cfg.prompt_list())
    queue, job = TaskQueue(redis_client, "msgctl"), JobState(redis_client, "msgctl")
    return Collector(led, queue, RunDir(tmp_path / "run", cfg), Dispatcher(led, queue, job))


@pytest.mark.parametrize(
    "junk, reason",
    [
        ({k: v for k, v in MESSAGES[3].to_json().items() if k != "blob"}, "missing key(s) blob"),
        ({**MESSAGES[3].to_json(), "rewards": "lots"}, "rewards: expected a list, got str"),
        (b"\xc1 not msgpack", "not a msgpack payload"),
    ],
    ids=["missing-key", "wrong-kind", "not-msgpack"],
)
def test_a_stored_result_that_does_not_read_is_quarantined_and_its_task_runs_again(
    redis_client, tmp_path: Path, junk, reason
):
    """Before this reading, a result without ``blob`` was a KeyError inside the controller,
    and one that was not msgpack sent its task to the dead letters (a poison task)."""
    c = make_collector(redis_client, tmp_path)
    c.ledger.book(0)
    task = GroupTask(iteration=0, group=0, prompt="a", sample_ids=(0, 1), version=0)
    payload = GenPayload(task)
    c.queue.put("gen", "gen:0:0", payload.to_json())
    c.ledger.outstanding["gen:0:0"] = ("gen", payload)
    assert c.queue.lease(["gen"], "rollout-0") is not None
    good = replace(MESSAGES[3], events=[replace(ROW, iteration=0, version=0)])
    assert c.queue.ack("gen:0:0", junk, worker="rollout-0")

    res = c.read("gen:0:0", c.queue.raw_result("gen:0:0"))
    assert res is None and c.collect("gen:0:0", res) == []
    assert quarantined_count(redis_client, "msgctl") == 1
    (record,) = c.queue.quarantined()
    assert record["from"] == "digen:msgctl:result:gen:0:0" and reason in record["reason"]
    assert c.queue.state("gen:0:0") == "pending"  # run again, its junk result gone
    assert c.queue.get_result("gen:0:0") is None and "gen:0:0" not in c.ledger.collected

    assert c.queue.lease(["gen"], "rollout-0") is not None  # the second run's result counts
    assert c.queue.ack("gen:0:0", good.to_json(), worker="rollout-0")
    (done,) = c.collect("gen:0:0", c.read("gen:0:0", c.queue.raw_result("gen:0:0")))
    assert done.worker == "rollout-0" and c.ledger.sources[0][0] == good.blob
    assert c.ledger.events[0]["task"] == "gen:0:0" and json.dumps(c.ledger.events)  # plain rows
    assert quarantined_count(redis_client, "msgctl") == 1


def test_a_junk_step_ack_is_quarantined_and_the_step_is_not_run_twice(redis_client, tmp_path: Path):
    c = make_collector(redis_client, tmp_path)
    c.queue.put("step", "step:0", {"iteration": 0, "mini_batch": 0})
    assert c.queue.lease(["step"], "trainer-0") is not None
    assert c.queue.ack("step:0", {"grad_norm": "big"}, worker="trainer-0")
    assert c.read("step:0", c.queue.raw_result("step:0")) is None
    assert quarantined_count(redis_client, "msgctl") == 1
    assert c.queue.state("step:0") == "done"  # applied by the trainers already: not posted again
