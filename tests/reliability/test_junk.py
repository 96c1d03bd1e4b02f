"""Junk in Redis: what is read back and is not a task id, a payload or a result is quarantined
(moved to the dead letters with the reason, counted), the job goes on, ``digen status`` shows
the count. The controller only ever sees valid task ids. Real Redis, real Dask workers."""

from __future__ import annotations

import json
import pickle
from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

from digen.cli.main import app
from digen.controlplane.queue import TaskQueue
from digen.core.events import TaskRef
from tests.reliability.conftest import (
    assert_equals_reference,
    assert_exactly_once,
    fault_config,
    metrics,
    run_job,
    timeline,
)

JUNK = [b"\xff\xfe\x00 not utf-8", b"not-a-task", b"gen:x:y", b"gen:0:0:7", pickle.dumps({"a": 1})]


@pytest.fixture()
def redis_db(tmp_path: Path):
    from digen.controlplane.redis_conn import connect, stop_embedded

    r = connect(None, db_path=tmp_path / "junk.db")
    yield r
    r.close()
    stop_embedded(tmp_path / "junk.db")


def test_task_ref_parse_names_what_is_not_a_task_id():
    assert TaskRef.parse("train:3:1:0").id == "train:3:1:0"
    for bad in ("not-a-task", "gen:x:y", "gen:1", "gen:1:2:0:0", "nope:1:2"):
        with pytest.raises(ValueError, match=r"is not a task id \(kind:iteration:group\[:part\]\)"):
            TaskRef.parse(bad)


def test_junk_on_done_dead_and_queue_lists_is_quarantined(redis_db):
    seen: list[dict] = []
    q = TaskQueue(redis_db, "junk", on_junk=seen.append)
    q.put("gen", "gen:0:0", {"task": 1})
    q.put("gen", "gen:0:1", {"task": 2})
    for raw in JUNK:
        redis_db.rpush("digen:junk:done", raw)
        redis_db.rpush("digen:junk:dead", raw)
        redis_db.lpush("digen:junk:q:gen", raw)  # ahead of the real tasks
    redis_db.hset(
        "digen:junk:task:not-a-task", mapping={"queue": "gen", "payload": b"\x80", "state": "pending"}
    )

    leased = q.lease(["gen"], "w0")
    assert leased is not None and leased.task_id == "gen:0:0"  # the junk ahead of it was skipped
    assert q.ack("gen:0:0", {"ok": 1}, worker="w0")
    assert q.pop_done() == ["gen:0:0"]  # only valid ids reach the controller
    assert q.dead_letters() == []
    assert redis_db.llen("digen:junk:dead") == 0  # junk taken off the dead list

    records = q.quarantined()
    assert {r["from"].split(":", 2)[2] for r in records} >= {"done", "dead", "q:gen"}
    assert any("not UTF-8 text (byte 0xff at offset 0)" in r["reason"] for r in records)
    assert any("not a task id" in r["reason"] and "'gen:x:y'" in r["reason"] for r in records)
    assert q.quarantined_count() == len(records) == len(seen) >= 2 * len(JUNK)
    assert all(s["action"] == "quarantined" for s in seen)


def test_an_unreadable_result_sends_its_task_to_the_dead_letters(redis_db):
    q = TaskQueue(redis_db, "junk")
    q.put("train", "train:0:0", {"spec": 1})
    assert q.lease(["train"], "w0") is not None
    assert q.ack("train:0:0", {"grad": 1}, worker="w0")
    redis_db.set("digen:junk:result:train:0:0", pickle.dumps(object))  # someone overwrote it
    assert q.get_result("train:0:0") is None  # never unpickled
    (dead,) = q.dead_letters()
    assert dead.task_id == "train:0:0" and "is not a digen result" in dead.error
    assert q.quarantined_count() == 1


def test_a_result_already_stored_completes_the_task_and_is_named(redis_db):
    """A result present while the task is still leased (junk, or a state change a restart
    lost): the stored result wins and the task is done, not "lease lost 3 times"; a task dead
    that way says so."""
    q = TaskQueue(redis_db, "junk", lease_s=30)
    q.put("gen", "gen:0:0", {"task": 1})
    assert q.lease(["gen"], "w0") is not None
    redis_db.set("digen:junk:result:gen:0:0", b"\x81\xa2ok\x01")  # msgpack {"ok": 1}
    assert not q.ack("gen:0:0", {"ok": 2}, worker="w0")  # not stored: the first result wins
    assert q.state("gen:0:0") == "done" and q.pop_done() == ["gen:0:0"]
    assert q.get_result("gen:0:0") == {"ok": 1}

    q.put("gen", "gen:0:1", {"task": 2})
    assert q.lease(["gen"], "w0") is not None
    redis_db.set("digen:junk:result:gen:0:1", b"x")
    deadline = redis_db.zscore("digen:junk:leases", "gen:0:1")
    q.requeue_expired(now=deadline + 1, max_attempts=1)
    (dead,) = q.dead_letters()
    assert dead.error.startswith("a result for task gen:0:1 was already stored")


@pytest.mark.slow
@pytest.mark.parametrize("on_poison", ["fail", "drop"])
def test_a_job_goes_on_with_junk_pushed_into_every_list(on_poison, tiny_sd3: Path, reference: Path, tmp_path):
    """Junk pushed into the done, dead and task lists of a running job (after iteration 0),
    and forged tasks with well-formed ids the controller never issued (a dead one, a done one,
    and a pending train task naming a weights version nobody serves): every iteration trains
    as a fault-free run would, in about its time; the junk is in dead_letters.jsonl."""
    from digen.controlplane.codec import pack
    from digen.controlplane.payloads import TrainPayload
    from digen.controlplane.redis_conn import connect
    from digen.task_records import TrainSpec

    cfg = fault_config(
        tiny_sd3,
        schedule={"mode": "disaggregated", "gap": True, "max_staleness": 0, "on_poison": on_poison},
        cluster__local={"rollout_workers": 1, "trainer_workers": 1},
    )
    out = tmp_path / "run"
    job_id = f"junk-{on_poison}"
    r = connect(None)
    pushed: list[int] = []

    def push_junk(m: dict) -> None:
        if "event" in m or pushed:
            return
        for raw in JUNK:
            for lst in ("done", "dead", "q:gen", "q:train"):
                r.rpush(f"digen:{job_id}:{lst}", raw)
        p = f"digen:{job_id}:"
        forged = TrainPayload(TrainSpec(0, 99, 0, [0], [0], [1.0]), version=999, prompt="forged")
        for task_id, queue, state in (("train:0:98", "train", "dead"), ("gen:0:97", "gen", "done")):
            r.hset(p + f"task:{task_id}", mapping={"queue": queue, "attempts": 9, "state": state})
            r.rpush(p + state, task_id)
        r.hset(p + "task:train:0:99", mapping={"queue": "train", "payload": pack(forged.to_json())})
        r.hset(p + "task:train:0:99", mapping={"attempts": 0, "state": "pending"})
        r.lpush(p + "q:train", "train:0:99")
        pushed.append(1)

    run_job(cfg, out, job_id, progress=push_junk)
    assert pushed
    assert_exactly_once(out)
    assert_equals_reference(out, reference)
    rows = [json.loads(x) for x in (out / "dead_letters.jsonl").read_text().splitlines()]
    assert rows and all(x["action"] == "quarantined" and x["reason"] for x in rows)
    assert {x["from"].removeprefix(f"digen:{job_id}:") for x in rows} >= {"done", "dead"}
    never = {x["junk"] for x in rows if "was never issued by this job's controller" in x["reason"]}
    assert never >= {"b'train:0:98'", "b'gen:0:97'", "b'train:0:99'"}  # the last: dead at once, then junk


@pytest.mark.slow
def test_results_that_do_not_read_are_quarantined_and_their_tasks_run_again(
    tiny_sd3: Path, reference: Path, tmp_path
):
    """Junk stored as the results of a generation and a train task of a running job (written
    before their workers acknowledge, so the junk is what the controller reads): each is
    quarantined and counted, its task runs again, and the job trains as a fault-free run
    would. Before the results were read as records this was a KeyError in the controller."""
    from digen.controlplane.codec import pack
    from digen.controlplane.redis_conn import connect
    from digen.testing.faults import Fault

    cfg = fault_config(
        tiny_sd3,
        schedule={"mode": "disaggregated", "gap": True, "max_staleness": 0},
        cluster__local={"rollout_workers": 1, "trainer_workers": 1},
    )
    out, job_id = tmp_path / "run", "junk-results"
    junk = {"gen:1:0": pack({"rewards": "lots", "worker": 7}), "train:1:1": b"\xc1 not msgpack"}
    r = connect(None)
    pushed: list[int] = []

    def write_junk(m: dict) -> None:  # after iteration 0's row; both tasks wait at their ack
        if "event" in m or pushed:
            return
        for task_id, raw in junk.items():
            r.set(f"digen:{job_id}:result:{task_id}", raw)
        r.sadd(f"digen:faults:{job_id}:flags", "junk-in")
        pushed.append(1)

    fired = run_job(
        cfg,
        out,
        job_id,
        *(Fault("ack", "hold", task=t, flag="junk-in", seconds=120) for t in junk),
        progress=write_junk,
    )
    assert sorted(f["task"] for f in fired if f["action"] == "hold") == sorted(junk)
    assert_exactly_once(out)
    assert_equals_reference(out, reference)
    rows = [json.loads(x) for x in (out / "dead_letters.jsonl").read_text().splitlines()]
    got = {x["from"].removeprefix(f"digen:{job_id}:"): x["reason"] for x in rows}
    assert len(rows) == 2 and set(got) == {"result:gen:1:0", "result:train:1:1"}  # each counted once
    assert "a GenResult that does not read" in got["result:gen:1:0"]
    assert "not a msgpack payload" in got["result:train:1:1"]
    r.close()
    # each task ran twice (the junk's run and the counted one); its rows are the counted run's
    tasks = Counter(e["task"] for e in timeline(out) if e["kind"] in ("gen", "train"))
    assert tasks["gen:1:0"] == 1 and tasks["train:1:1"] == 1


def test_digen_status_shows_the_count(tiny_sd3: Path, tmp_path: Path, monkeypatch):
    """The runner copies the attempt's count into the job's meta; status shows it."""
    from digen.controlplane.redis_conn import connect, stop_embedded
    from digen.service import jobs
    from digen.service.runner import _note_quarantined
    from tests.service.helpers import CONFIG, quick_sets

    monkeypatch.setenv("DIGEN_HOME", str(tmp_path / "home"))
    res = CliRunner().invoke(
        app, ["submit", str(CONFIG), *quick_sets(tiny_sd3), "--out", str(tmp_path / "run")]
    )
    assert res.exit_code == 0, res.output
    job_id = res.stdout.strip()
    r = connect(None, db_path=tmp_path / "home" / "digen.db")
    try:
        q = TaskQueue(r, f"{job_id}.1")
        for raw in JUNK[:3]:
            r.rpush(f"digen:{job_id}.1:done", raw)
        assert q.pop_done() == []
        _note_quarantined(r, jobs._fetch(r, job_id), 1)
        shown = json.loads(CliRunner().invoke(app, ["status", job_id, "--json"]).stdout)
        assert shown["quarantined"] == 3
        r.zadd(jobs.INDEX_KEY, {b"\xff\xfe junk": 1.0, "no-such-job": 2.0})  # junk in the index too
        res = CliRunner().invoke(app, ["status"])
        assert res.exit_code == 0, res.output
        assert "QUARANTINED" in res.stdout and " 3 " in res.stdout
        assert r.zrange(jobs.INDEX_KEY, 0, -1) == [job_id.encode()]  # junk dropped from the index
    finally:
        r.close()
        stop_embedded(tmp_path / "home" / "digen.db")


def _unreadable_ack() -> bytes:
    """A StepAck that does not read: its version is not a number, its times are missing."""
    from digen.controlplane.codec import pack

    return pack({"worker": "w", "version": "v2", "grad_norm": 1.0})


def _forged_ack() -> bytes:
    """A StepAck that reads, naming a version no step of the job makes next."""
    from digen.controlplane.codec import pack
    from digen.controlplane.messages import StepAck

    return pack(StepAck(worker="trainer-0", start=0.0, end=0.0, grad_norm=0.5, version=7).to_json())


JUNK_ACKS = {
    "unreadable": (_unreadable_ack, "a StepAck that does not read"),
    "another version": (_forged_ack, "a StepAck of version 7, the step makes 2"),
}


def _junk_step_ack(job_id: str, step: str, pushed: list[int], junk: bytes | None = None):
    """A progress callback that stores ``junk`` (default: an unreadable StepAck) as the result
    of step ``step`` after iteration 0's row: before the controller asks for that step (it asks
    once iteration ``step``'s train tasks are done, which run on the version iteration 0's step
    made), so the step's acknowledgement finds it there and the junk is what the controller reads."""
    from digen.controlplane.redis_conn import connect

    raw = _unreadable_ack() if junk is None else junk

    def write_junk(m: dict) -> None:
        if "event" in m or pushed:
            return
        r = connect(None)
        try:
            r.set(f"digen:{job_id}:result:{step}", raw)
        finally:
            r.close()
        pushed.append(1)

    return write_junk


def _assert_step_ack_quarantined(
    out: Path, job_id: str, step: str, reason: str = "a StepAck that does not read"
) -> None:
    """The junk stored as the acknowledgement of ``step`` was quarantined (once: it goes with
    the re-posted step, and the group's second acknowledgement reads) and counted."""
    rows = [json.loads(x) for x in (out / "dead_letters.jsonl").read_text().splitlines()]
    got = [x for x in rows if x["from"] == f"digen:{job_id}:result:{step}"]
    assert len(got) == 1 and got[0]["action"] == "quarantined", rows
    assert reason in got[0]["reason"], got


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(JUNK_ACKS))
def test_a_step_acknowledgement_that_does_not_read_is_asked_for_again(
    kind: str, tiny_sd3: Path, reference: Path, tmp_path
):
    """Junk stored as the acknowledgement of a replicated trainer group's step (one that does
    not read, or one that reads and names another version than the step makes): it is
    quarantined and counted, the controller asks the group again (the command written once
    more, same id), the writer, which applied the step already, acknowledges it again without
    stepping twice: every iteration trains once, the version moves once a step, and the run
    equals the fault-free reference bit for bit (a second step would move the weights). Before
    the re-ask the job waited for that step for ever."""
    cfg = fault_config(
        tiny_sd3,
        schedule={"mode": "disaggregated", "gap": True, "max_staleness": 0},
        cluster__local={"rollout_workers": 1, "trainer_workers": 1},
    )
    make, reason = JUNK_ACKS[kind]
    out, job_id, pushed = tmp_path / "run", f"junk-step-ack-{kind.replace(' ', '-')}", []
    run_job(cfg, out, job_id, progress=_junk_step_ack(job_id, "step:1", pushed, make()))
    assert pushed
    assert_exactly_once(out)
    assert_equals_reference(out, reference)
    assert [m["policy_version"] for m in metrics(out)] == [1, 2, 3]
    _assert_step_ack_quarantined(out, job_id, "step:1", reason)
    optim = Counter(e["iteration"] for e in timeline(out) if e["kind"] == "optim")
    assert optim == {0: 1, 1: 1, 2: 1}


@pytest.mark.slow
def test_an_fsdp_step_acknowledgement_that_does_not_read_is_asked_for_again(
    tiny_sd3: Path, reference: Path, tmp_path
):
    """The same for an FSDP group's step (one rank, which leads): the step command is re-posted,
    the leader, which applied it already, leases it and acknowledges it again without a step."""
    cfg = fault_config(
        tiny_sd3,
        train__fsdp=True,
        schedule={"mode": "disaggregated", "gap": True, "max_staleness": 0},
        cluster__local={"rollout_workers": 1, "trainer_workers": 1},
    )
    out, job_id, pushed = tmp_path / "run", "junk-fsdp-step-ack", []
    run_job(cfg, out, job_id, progress=_junk_step_ack(job_id, "step:1", pushed))
    assert pushed
    assert_exactly_once(out)
    assert_equals_reference(out, reference)
    assert [m["policy_version"] for m in metrics(out)] == [1, 2, 3]
    _assert_step_ack_quarantined(out, job_id, "step:1")
    optim = Counter(e["iteration"] for e in timeline(out) if e["kind"] == "optim")
    assert optim == {0: 1, 1: 1, 2: 1}


@pytest.mark.slow
def test_a_step_acknowledgement_that_never_reads_fails_the_job_naming_the_step(tiny_sd3: Path, tmp_path):
    """The re-asks are bounded by ``schedule.max_attempts``: at 1, the first junk
    acknowledgement fails the job with one line naming the step (never a job that asks for
    ever while something keeps writing junk there)."""
    from digen.errors import DigenError

    cfg = fault_config(
        tiny_sd3,
        schedule={"mode": "disaggregated", "gap": True, "max_staleness": 0, "max_attempts": 1},
        cluster__local={"rollout_workers": 1, "trainer_workers": 1},
    )
    out, job_id, pushed = tmp_path / "run", "junk-step-ack-bound", []
    with pytest.raises(DigenError) as err:
        run_job(cfg, out, job_id, progress=_junk_step_ack(job_id, "step:1", pushed))
    assert pushed
    assert str(err.value).startswith(
        "the acknowledgement of the optimizer step step:1 did not read 1 times (schedule.max_attempts 1;"
    )
    assert "\n" not in str(err.value)
    _assert_step_ack_quarantined(out, job_id, "step:1")
    assert [m["iteration"] for m in metrics(out)] == [0]
