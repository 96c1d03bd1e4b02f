"""Forged tasks written into a job's real Redis keys (as anyone holding the Redis password
can) neither kill nor stall the job: an id the controller never issued is quarantined as
junk and counted, never a poison task; an id on a queue list with no task behind it is
counted too; a train task naming a weights version nobody serves fails in seconds instead
of holding its worker for WEIGHTS_WAIT_S. Real embedded Redis, nothing mocked."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from digen.controlplane.codec import pack
from digen.controlplane.jobstate import JobState
from digen.controlplane.queue import TaskQueue
from digen.controlplane.trainer_group import TrainerGroup


@pytest.fixture()
def redis_db(tmp_path: Path):
    from digen.controlplane.redis_conn import connect, stop_embedded

    r = connect(None, db_path=tmp_path / "forged.db")
    yield r
    r.close()
    stop_embedded(tmp_path / "forged.db")


def _forge_task(r, job: str, task_id: str, queue: str, state: str, **fields) -> None:
    r.hset(
        f"digen:{job}:task:{task_id}",
        mapping={"queue": queue, "payload": pack({"forged": True}), "attempts": 3, "state": state, **fields},
    )


def test_a_dead_task_the_controller_never_issued_is_junk_not_poison(redis_db):
    seen: list[dict] = []
    q = TaskQueue(redis_db, "job", on_junk=seen.append, issued_only=True)
    q.put("gen", "gen:0:0", {"task": 0})
    q.put("train", "train:0:0", {"task": 1})
    # forged: a well-formed dead train task and a done gen task, with their hashes
    _forge_task(redis_db, "job", "train:0:9", "train", "dead", error="RuntimeError: forged")
    redis_db.rpush("digen:job:dead", "train:0:9")
    _forge_task(redis_db, "job", "gen:0:7", "gen", "done")
    redis_db.rpush("digen:job:done", "gen:0:7")

    leased = q.lease(["train"], "w0")
    assert leased is not None and leased.task_id == "train:0:0"
    assert q.nack("train:0:0", "RuntimeError: real failure", max_attempts=1, worker="w0") == "dead"
    assert [d.task_id for d in q.dead_letters()] == ["train:0:0"]  # the issued one alone: poison
    assert redis_db.lrange("digen:job:dead", 0, -1) == [b"train:0:0"]  # the forged one taken off
    assert q.pop_done() == []
    reasons = sorted(r["reason"] for r in q.quarantined())
    assert reasons == [
        "task id 'gen:0:7' was never issued by this job's controller",
        "task id 'train:0:9' was never issued by this job's controller",
    ]
    assert q.quarantined_count() == 2 == len(seen)


def test_ids_with_no_task_behind_them_on_a_queue_list_are_counted(redis_db):
    """They were dropped by the lease script without a word; the docstring counts them."""
    q = TaskQueue(redis_db, "job")
    q.put("gen", "gen:0:0", {"task": 0})
    for raw in (b"gen:0:5", b"not-a-task", b"\xff junk"):
        redis_db.lpush("digen:job:q:gen", raw)  # ahead of the real task
    leased = q.lease(["gen"], "w0")
    assert leased is not None and leased.task_id == "gen:0:0"
    assert q.quarantined_count() == 3
    reasons = {r["reason"] for r in q.quarantined()}
    assert "no task 'gen:0:5' stands behind this id on a queue list" in reasons
    redis_db.rpush("digen:job:q:gen", "gen:0:6")  # with nothing left to lease, still counted
    assert q.lease(["gen"], "w0") is None
    assert q.quarantined_count() == 4


def test_a_version_nobody_serves_fails_in_seconds(redis_db):
    from digen.workers.context import WEIGHTS_WAIT_S, WorkerContext

    job, tasks = JobState(redis_db, "job"), TaskQueue(redis_db, "job")
    job.set_status("running")
    group = TrainerGroup(redis_db, "job")
    group.set_holding("trainer-0", "127.0.0.1:1", [3, 4], 4)
    ctx = WorkerContext("rollout-0", "cpu", None, tasks, job, "cpu")  # type: ignore[arg-type]
    for version, why in (
        (999, "no step makes it next (the trainers serve versions 3 to 4)"),
        (2, "no trainer serves it any more (they serve versions 3 to 4)"),
    ):
        start = time.monotonic()
        with pytest.raises(
            RuntimeError, match=re.escape(f"weights version {version} cannot be fetched: {why}")
        ):
            ctx._fetch_weights(version)
        assert time.monotonic() - start < WEIGHTS_WAIT_S / 30  # seconds, not 300
    assert group.why_unserved(5) is None  # the next version: the step in flight may make it
    assert group.why_unserved(4) is None
    group.drop_holding("trainer-0")
    assert group.why_unserved(999) is None  # nothing served yet (trainers loading): wait
    redis_db.hset("digen:job:tg:holders", "forged", '{"addr": "x", "versions": ["a", true, null]}')
    assert group.why_unserved(999) is None  # junk versions are not served versions
