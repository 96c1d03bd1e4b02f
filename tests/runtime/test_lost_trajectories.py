"""What a rollout worker that left takes with it (real embedded Redis, no cluster): only the
trajectories a train task may still read are generated again, and a dead task that nothing
waits for any more (its iteration finished) does not fail the job (digen/runtime/ledger.py,
digen/runtime/results.py)."""

from __future__ import annotations

from pathlib import Path

from digen.config import Config
from digen.controlplane.jobstate import JobState
from digen.controlplane.messages import BlobRef
from digen.controlplane.queue import DeadLetter, TaskQueue
from digen.core.events import GroupLost
from digen.rundir import RunDir
from digen.runtime.dispatch import Dispatcher
from digen.runtime.ledger import Ledger
from digen.runtime.results import Collector
from tests.conftest import small_config_data


def make_collector(redis_client, tmp_path: Path) -> Collector:
    """Iteration 2 of a job of 2 groups in 2 mini-batches, both groups generated on rollout-0."""
    data = small_config_data(
        tmp_path / "model",
        schedule={"mode": "digen", "max_staleness": 1},
        train__mini_batches=2,
        iterations=4,
    )
    cfg = Config.model_validate(data)
    led = Ledger(cfg, cfg.prompt_list())
    book = led.book(2)
    for g in range(2):
        book.add_rewards(g, [0.1 * g, 0.2, 0.3, 0.4 + g])
        led.sources.setdefault(2, {})[g] = BlobRef("127.0.0.1:9000", f"j:traj:gen:2:{g}", worker="rollout-0")
    queue = TaskQueue(redis_client, "lost")
    return Collector(
        led, queue, RunDir(tmp_path / "run", cfg), Dispatcher(led, queue, JobState(redis_client, "lost"))
    )


def test_a_group_whose_mini_batch_is_committed_is_not_generated_again(redis_client, tmp_path: Path):
    collector = make_collector(redis_client, tmp_path)
    led = collector.ledger
    assert [led.books[2].mini_batch(g) for g in range(2)] == [0, 1]
    led.committed[2] = {"train:2:0": 4}  # mini-batch 0's step is committed: group 0 is trained
    events = collector.worker_left("rollout-0", now=1.0)
    assert [(e.iteration, e.group) for e in events if isinstance(e, GroupLost)] == [(2, 1)]
    assert led.regenerating == {(2, 1)} and 0 in led.sources[2]


def test_before_its_step_commits_a_lost_group_is_generated_again(redis_client, tmp_path: Path):
    collector = make_collector(redis_client, tmp_path)
    events = collector.worker_left("rollout-0", now=1.0)
    assert sorted((e.iteration, e.group) for e in events if isinstance(e, GroupLost)) == [(2, 0), (2, 1)]


def test_a_dead_task_of_a_finished_iteration_does_not_fail_the_job(redis_client, tmp_path: Path):
    collector = make_collector(redis_client, tmp_path)
    assert collector.ledger.cfg.schedule.on_poison == "fail"
    collector.ledger.forget(2)  # iteration 2 finished while a copy of gen:2:0 was still queued
    dead = DeadLetter("gen:2:0", "gen", "RuntimeError: weights version 2 cannot be fetched", 3)
    assert collector.poisoned(dead) == []
    assert (tmp_path / "run" / "dead_letters.jsonl").read_text().count("gen:2:0") == 1  # still recorded
