"""Task payloads: every record survives the queue's msgpack round trip; junk from Redis is a
PayloadError when a worker reads it, never a KeyError deep in a task."""

from __future__ import annotations

import pytest

from digen.controlplane.codec import pack, unpack
from digen.controlplane.messages import BlobRef
from digen.controlplane.payloads import (
    EvalPayload,
    FsdpStepPayload,
    GenPayload,
    RewardPayload,
    StepPayload,
    TrainEntry,
    TrainPayload,
    with_sources,
)
from digen.errors import PayloadError
from digen.evaluation import EvalTask
from digen.task_records import GroupTask, TrainSpec

GROUP = GroupTask(iteration=2, group=1, prompt="a red square", sample_ids=(4, 5), version=2)
SPEC = TrainSpec(
    iteration=2, group=1, gen_version=2, samples=[0, 1], sample_ids=[4, 5], advantages=[1.0, -1.0]
)
SPEC2 = TrainSpec(iteration=2, group=2, gen_version=2, samples=[1], sample_ids=[9], advantages=[0.5])
SOURCE = BlobRef("127.0.0.1:9000", "j:traj:gen:2:1", "abc", 2)


def eval_task() -> EvalTask:
    return EvalTask(iteration=3, chunk=1, version=4, indices=(2,), prompts=("c",))


@pytest.mark.parametrize(
    "payload",
    [
        GenPayload(GROUP, score=False, grid=True),
        RewardPayload(GROUP, SOURCE),
        RewardPayload(GROUP, None),
        TrainPayload(SPEC, 5, "a red square", tsp=True, source=SOURCE),
        TrainPayload(SPEC, 5, "a red square", source=SOURCE, keep_gradient=True),
        TrainPayload(
            SPEC, 5, "a red square", source=SOURCE, batch=(TrainEntry(SPEC2, "a blue circle", None),)
        ),
        StepPayload(2, 1),
        FsdpStepPayload(2, 1, True, 16, "/runs/x/checkpoints/iter_0002", None),
    ],
)
def test_a_payload_reads_back_equal_after_the_queue(payload):
    assert type(payload).read(unpack(pack(payload.to_json()))) == payload


def test_an_eval_payload_reads_back():
    payload = EvalPayload(eval_task())
    assert EvalPayload.read(unpack(pack(payload.to_json()))) == payload


@pytest.mark.parametrize(
    "raw",
    [
        None,
        [1, 2],
        {},
        {"task": "fine"},
        {"task": {**GROUP.to_json(), "version": "two"}},
        {"task": GROUP.to_json(), "score": "yes"},  # a bool is a bool
        {"task": GROUP.to_json(), "grid": 1},
    ],
)
def test_junk_is_a_payload_error(raw):
    with pytest.raises(PayloadError, match="GenPayload"):
        GenPayload.read(raw)


def test_a_train_payload_with_a_bad_source_is_refused():
    good = TrainPayload(SPEC, 5, "p", source=SOURCE).to_json()
    with pytest.raises(PayloadError):
        TrainPayload.read({**good, "source": {"addr": "127.0.0.1:1"}})
    with pytest.raises(PayloadError):
        TrainPayload.read({**good, "version": None})


def test_defaults_may_be_absent_and_a_repost_moves_the_sources():
    assert GenPayload.read({"task": GROUP.to_json()}) == GenPayload(GROUP)
    moved, other = BlobRef("127.0.0.1:9001", "j:traj:gen:2:1"), BlobRef("127.0.0.1:9002", "j:traj:gen:2:2")
    assert with_sources(TrainPayload(SPEC, 5, "p", source=SOURCE), [moved]).source == moved
    batched = TrainPayload(SPEC, 5, "p", source=SOURCE, batch=(TrainEntry(SPEC2, "q", None),))
    reposted = with_sources(batched, [moved, other])
    assert [e.source for e in reposted.entries()] == [moved, other]
    assert [e.spec.group for e in reposted.entries()] == [1, 2]
    assert with_sources(GenPayload(GROUP), [moved]) == GenPayload(GROUP)
