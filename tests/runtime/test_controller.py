"""The controller's per-iteration timing: busy time is each task's overlap with the
iteration's window, whatever iteration the task belongs to (a hand-built timeline), and the
tasks still running at the window's end count up to it (real embedded Redis)."""

from __future__ import annotations

import math
import time
from concurrent.futures import Future
from dataclasses import dataclass

import pytest

from digen.controlplane.messages import BlobRef, GenResult
from digen.controlplane.queue import TaskQueue
from digen.core.timeline import TimelineRow
from digen.iteration import busy_seconds, timing_metrics
from digen.runtime.controller import in_flight_events


def ev(worker: str, kind: str, iteration: int, start: float, end: float) -> dict:
    return {"worker": worker, "kind": kind, "iteration": iteration, "start": start, "end": end}


# two workers, iteration 0 in [0, 10], iteration 1 in [10, 20]; with GAP the rollout worker
# generates iteration 1's group from t=6 while the trainer still trains iteration 0
TIMELINE = [
    ev("rollout-0", "gen", 0, 0, 4),
    ev("rollout-0", "gen", 1, 6, 14),  # straddles the boundary at t=10
    ev("trainer-0", "train", 0, 4, 9),
    ev("trainer-0", "sync", 1, 9, 10),  # loading weights is not busy time
    ev("trainer-0", "train", 1, 14, 19),
]


def test_a_task_straddling_the_boundary_counts_in_both_windows():
    assert busy_seconds(TIMELINE, 0, 10) == 4 + 4 + 5
    assert busy_seconds(TIMELINE, 10, 20) == 4 + 5
    # nothing counted twice, nothing lost: the windows add up to the whole timeline's busy time
    assert busy_seconds(TIMELINE, 0, 10) + busy_seconds(TIMELINE, 10, 20) == busy_seconds(TIMELINE) == 22
    m = timing_metrics(TIMELINE, 2, 10.0, 8, window=(0, 10))
    assert m["busy_s"] == 13 and m["worker_s"] == 20
    assert m["bubble_ratio"] == pytest.approx(1 - 13 / 20)
    # by iteration instead of by window, iteration 0 would be 9 s busy and iteration 1 13 s
    assert busy_seconds([e for e in TIMELINE if e["iteration"] == 0], 0, 10) == 9


DONE = [("gen", 100.0, 101.5), ("sync", 99.5, 100.0)]


def test_tasks_in_flight_at_the_window_end_count_up_to_it(redis_client):
    queue = TaskQueue(redis_client, "timing", lease_s=30)
    ids = ["gen:1:0", "gen:1:1", "gen:1:2"]
    for tid in ids:
        queue.put("gen", tid, {"n": 1})
    before = time.time()
    running = queue.lease(["gen"], "rollout-0")
    after = time.time()
    finished = queue.lease(["gen"], "rollout-1")
    assert running is not None and finished is not None
    rows = [TimelineRow("rollout-1", "cpu", "rollout", k, 1, 0, s, e) for k, s, e in DONE]
    res = GenResult(worker="rollout-1", start=99.5, end=101.5, events=rows, blob=BlobRef("a:1", "t"))
    assert queue.ack(finished.task_id, res.to_json(), worker="rollout-1")
    done_events = [r.to_json() for r in rows]
    # ids[2] is still pending: it has not run

    now = after + 5.0
    got = in_flight_events(queue, ids, now)
    spans = [e for e in got if e["kind"] == "task"]
    assert len(spans) == 1 and before <= spans[0]["start"] <= after and spans[0]["end"] == now
    assert [e for e in got if e["kind"] != "task"] == done_events
    # clipped to the window: the running task from its lease to now, the done one's gen step
    window = (spans[0]["start"] - 1.0, now)
    assert busy_seconds(got, *window) == pytest.approx(now - spans[0]["start"])
    assert in_flight_events(queue, [ids[2]], now) == []


def test_an_instruction_without_a_handler_raises_and_finish_finishes():
    """The controller carries out every instruction the scheduler gives or says it cannot:
    an unknown one is a TypeError naming it, never dropped."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    from digen.core.events import Finish
    from digen.runtime.controller import Controller

    @dataclass(frozen=True)
    class Teleport:
        worker: str

    def bare() -> SimpleNamespace:  # a controller with nothing to dispatch (apply queues at once)
        return SimpleNamespace(dispatch=SimpleNamespace(together=nullcontext))

    with pytest.raises(TypeError, match=r"no handler for instruction .*Teleport\(worker=.w0.\)"):
        Controller.apply(bare(), [Finish(), Teleport("w0")])  # type: ignore[arg-type]
    assert Controller.apply(bare(), [Finish()]) is True  # type: ignore[arg-type]
    assert Controller.apply(bare(), []) is False  # type: ignore[arg-type]


def test_what_start_up_events_ask_is_applied_not_dropped(redis_client):
    """Before the scheduler starts, a worker that left (a sequence-parallel follower hidden
    from the scheduler, say) is requeued: :meth:`Controller.take` applies what handling asks."""
    from types import SimpleNamespace

    from digen.controlplane.jobstate import JobState
    from digen.core.events import RequeueWorker, WorkerLeft
    from digen.runtime.controller import Controller
    from digen.runtime.dispatch import Dispatcher

    queue = TaskQueue(redis_client, "startup", lease_s=30)
    queue.put("gen", "gen:0:0", {"n": 1})
    assert queue.lease(["gen"], "rollout-1") is not None
    dispatch = Dispatcher(SimpleNamespace(), queue, JobState(redis_client, "startup"))  # type: ignore[arg-type]
    ctl = SimpleNamespace(dispatch=dispatch, handle=lambda events: [RequeueWorker(e.worker) for e in events])
    ctl.apply = lambda instructions: Controller.apply(ctl, instructions)  # type: ignore[arg-type]
    Controller.take(ctl, [WorkerLeft("rollout-1", 0.0)])  # type: ignore[arg-type]
    assert queue.state("gen:0:0") == "pending"


class _Loop(Future):
    """A worker loop's future as the controller sees it (``result(timeout=...)``), recording
    every wait asked of it; one that never finishes is a loop still busy with a task."""

    def __init__(self, done: bool):
        super().__init__()
        self.waits: list[float] = []
        if done:
            self.set_result({"tasks": 1})

    def result(self, timeout=None):
        self.waits.append(timeout)
        return super().result(timeout=timeout)


def test_after_a_ctrl_c_the_loops_are_waited_on_for_interrupt_wait_s_in_all():
    """After a Ctrl-C the controller waits for the worker loops :data:`INTERRUPT_WAIT_S` in
    all (a few seconds, so the job stops well within 5 s), then ends those still busy with the
    cluster; it used to wait 30 s on each loop, one after another (60 s with two workers that
    never answered). Decided by the waits asked of the futures, not by a clock."""
    from digen.runtime.controller import INTERRUPT_WAIT_S, LOOP_WAIT_S, await_loops

    assert INTERRUPT_WAIT_S <= 3.0 < LOOP_WAIT_S
    loops = [_Loop(done=False), _Loop(done=True), _Loop(done=False)]
    total = 0.2  # INTERRUPT_WAIT_S's role, short so the test does not sleep 3 s
    assert await_loops(loops, per_loop_s=LOOP_WAIT_S, total_s=total) == (1, 2)
    waits = [w for fut in loops for w in fut.waits]
    assert len(waits) == 3 and sum(waits) <= total, waits
    # a job that was not interrupted waits for each loop up to LOOP_WAIT_S, as before
    ended = [_Loop(done=True), _Loop(done=True)]
    assert await_loops(ended, per_loop_s=LOOP_WAIT_S, total_s=math.inf) == (2, 0)
    assert [w for fut in ended for w in fut.waits] == [LOOP_WAIT_S, LOOP_WAIT_S]
