"""The step invariant on the controller's side (real embedded Redis, no cluster): a step's
command lists exactly the train tasks of its mini-batch whose gradients are held, a worker that
left mid-step loses what the decision says (also when a worker of its name is back), members
are incarnations, and the books follow the committed steps (digen/runtime/steps.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from digen.config import Config
from digen.controlplane.messages import BlobRef
from digen.controlplane.payloads import TrainPayload
from digen.controlplane.queue import TaskQueue
from digen.controlplane.trainer_group import ABORT, StepCommand, TrainerGroup
from digen.core.events import TaskRef
from digen.errors import DigenError
from digen.rundir import RunDir
from digen.runtime.ledger import Ledger, Trained
from digen.runtime.steps import StepControl
from digen.task_records import TrainSpec, TrainStats
from tests.conftest import small_config_data

TASKS = ["train:1:0", "train:1:1"]


def make_steps(redis_client, tmp_path: Path, reduce: str) -> StepControl:
    """Iteration 1 of a 2-group job, both train tasks released; none collected yet."""
    data = small_config_data(
        tmp_path / "model", schedule={"mode": "digen", "max_staleness": 0}, train__reduce=reduce, iterations=3
    )
    cfg = Config.model_validate(data)
    ledger = Ledger(cfg, cfg.prompt_list())
    book = ledger.book(1)
    for g in range(2):
        book.add_rewards(g, [0.1 * g, 0.2, 0.3, 0.4 + g])
    ledger.train_released[1] = set(TASKS)
    queue, group = TaskQueue(redis_client, "steps"), TrainerGroup(redis_client, "steps")
    return StepControl(cfg, RunDir(tmp_path / "run", cfg), queue, group, ledger, version=1)


def collect(steps: StepControl, task_id: str, worker: str, blob: bool) -> None:
    """What the collector records for an acknowledged train task."""
    ref = TaskRef.parse(task_id)
    held = BlobRef(f"127.0.0.1:{9000 + ref.group}", f"steps:grad:{task_id}", worker=worker) if blob else None
    steps.ledger.trained.setdefault(1, {})[task_id] = Trained(ref, worker, held)
    steps.ledger.books[1].stats[(ref.group, 0)] = TrainStats(rows=8)


MEMBERS = ["trainer-0", "trainer-1"]
FIRST = {"trainer-0": "a", "trainer-1": "b"}


def test_a_step_whose_task_no_member_holds_is_never_asked(redis_client, tmp_path: Path):
    steps = make_steps(redis_client, tmp_path, "exact")
    collect(steps, "train:1:0", "trainer-0", blob=True)
    with pytest.raises(DigenError, match=r"train task train:1:1 \(no member holds its gradient\)"):
        steps.request(1, MEMBERS, 0, FIRST)
    assert steps.inflight is None and steps.group.step() is None  # nothing was written


def test_a_command_lists_every_held_task_and_divides_by_their_rows(redis_client, tmp_path: Path):
    steps = make_steps(redis_client, tmp_path, "allreduce")
    collect(steps, "train:1:0", "trainer-0", blob=False)
    collect(steps, "train:1:1", "rollout-0", blob=True)  # RAT: a rollout worker's blob
    assert steps.request(1, MEMBERS, 0, FIRST)
    cmd = steps.group.step()
    assert cmd is not None and cmd.tasks() == TASKS and cmd.rows == 16
    assert cmd.held == {"trainer-0": ["train:1:0"]} and [b.task for b in cmd.blobs] == ["train:1:1"]
    assert cmd.incarnations == FIRST
    with pytest.raises(DigenError, match="in flight"):  # never a second command over the first
        steps.request(1, MEMBERS, 0, FIRST)


@pytest.mark.parametrize(("reduce", "seen_leaving"), [("exact", True), ("allreduce", True), ("exact", False)])
def test_a_member_restarted_under_its_name_aborts_the_step_and_what_it_held_runs_again(
    redis_client, tmp_path: Path, reduce: str, seen_leaving: bool
):
    steps = make_steps(redis_client, tmp_path, reduce)
    collect(steps, "train:1:0", "trainer-0", blob=reduce == "exact")
    collect(steps, "train:1:1", "trainer-1", blob=reduce == "exact")
    assert steps.request(1, MEMBERS, 0, FIRST)
    epoch = steps.epoch
    steps.group.report_ok("step:1", epoch, "trainer-0")  # trainer-0 reported; trainer-1 died
    if seen_leaving:  # else only its new incarnation tells
        steps.worker_left("trainer-1")
    assert steps.in_flight_tasks() == set(TASKS)  # the ledger keeps them: the decision settles them
    # the restarted trainer-1 is back under its name before the controller looks
    lost = steps.check({"trainer-0": "a", "trainer-1": "b2"})
    assert steps.group.decision("step:1") == f"{ABORT}:{epoch}"
    # exact: only trainer-1's blob is gone; allreduce: every member drops its running sum
    assert [t.id for t in lost or []] == (["train:1:1"] if reduce == "exact" else TASKS)
    assert [(a["step"], a["gone"]) for a in steps.aborts] == [("step:1", ["trainer-1"])]


def test_a_new_incarnation_under_the_same_name_is_another_epoch(redis_client, tmp_path: Path):
    steps = make_steps(redis_client, tmp_path, "exact")
    collect(steps, "train:1:0", "trainer-0", blob=True)
    collect(steps, "train:1:1", "trainer-1", blob=True)
    assert steps.request(1, MEMBERS, 0, FIRST)
    first = steps.epoch
    steps.inflight = None  # (as if it had committed)
    assert steps.request(1, MEMBERS, 0, FIRST)
    assert steps.epoch == first
    steps.inflight = None
    assert steps.request(1, MEMBERS, 0, {"trainer-0": "a", "trainer-1": "b2"})
    assert steps.epoch == first + 1


def test_a_command_asks_only_the_incarnations_it_names():
    cmd = StepCommand("step:1", 1, 2, MEMBERS, 1, 16, incarnations=FIRST)
    assert cmd.names("trainer-1", "b")
    assert not cmd.names("trainer-1", "b2")  # restarted: its predecessor was asked
    assert not cmd.names("trainer-2", "c")
    assert StepCommand("step:1", 1, 2, MEMBERS, 1, 16).names("trainer-1", "any")  # no incarnations named


def test_the_books_count_only_committed_tasks(redis_client, tmp_path: Path):
    steps = make_steps(redis_client, tmp_path, "exact")
    led = steps.ledger
    collect(steps, "train:1:0", "trainer-0", blob=True)
    collect(steps, "train:1:1", "trainer-1", blob=True)
    led.committed[1] = {"train:1:0": 8}  # (a step that summed train:1:1 never committed)
    assert led.settle(1) == ["train:1:1"]
    assert led.dead[1] == ["train:1:1"] and led.untrained[1] == {(1, None)}
    assert led.books[1].metrics()["trained_rows"] == 8


def test_a_writer_restarted_after_the_commit_is_replaced_by_a_member_that_holds_the_state(
    redis_client, tmp_path: Path
):
    steps = make_steps(redis_client, tmp_path, "exact")
    collect(steps, "train:1:0", "trainer-0", blob=True)
    collect(steps, "train:1:1", "trainer-1", blob=True)
    assert steps.request(1, ["trainer-0", "trainer-1"], 0, FIRST)
    steps.group.decide("step:1", "commit", steps.epoch)
    # the writer (rank 0) is back under its name, a new incarnation: it holds nothing
    assert steps.check({"trainer-0": "a2", "trainer-1": "b"}) is None
    cmd = steps.group.step()
    assert cmd is not None and cmd.writer == "trainer-1" and steps.aborts == []


def test_a_train_result_of_a_worker_process_gone_since_is_not_counted_and_runs_again(
    redis_client, tmp_path: Path
):
    from digen.controlplane.jobstate import JobState
    from digen.runtime.dispatch import Dispatcher
    from digen.runtime.results import Collector

    steps = make_steps(redis_client, tmp_path, "exact")
    led, queue, job = steps.ledger, steps.queue, JobState(redis_client, "steps")
    collector = Collector(led, queue, steps.run, Dispatcher(led, queue, job))
    spec = TrainSpec(iteration=1, group=0, gen_version=0, samples=[0], sample_ids=[0], advantages=[1.0])
    payload = TrainPayload(spec, version=1, prompt="a")
    for tid in TASKS:
        queue.put("train", tid, payload.to_json())
        led.outstanding[tid] = ("train", payload)
    job.claim_loop("trainer-1", "b2")  # trainer-1 restarted after it acknowledged train:1:1
    res = {
        "worker": "trainer-1",
        "incarnation": "b",
        "events": [],
        "stats": TrainStats(rows=8).to_json(),
        "grad": {"addr": "127.0.0.1:9001", "name": "steps:grad:train:1:1"},
        "start": 0.0,
        "end": 1.0,
    }
    assert collector.collect("train:1:1", collector.read("train:1:1", res)) == []
    assert "train:1:1" not in led.trained.get(1, {}) and "train:1:1" not in led.collected
    assert queue.state("train:1:1") == "pending"  # queued to run again
    assert [
        e.task.id
        for e in collector.collect("train:1:1", collector.read("train:1:1", {**res, "incarnation": "b2"}))
    ] == ["train:1:1"]
    assert "train:1:1" in led.trained[1]
