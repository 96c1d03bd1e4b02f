"""Evaluation rides in the bubbles: the real Scheduler and pull order on a simulated clock.

A small discrete-event harness plays the controller (releases into per-kind queues, steps)
and the workers (an idle worker leases the first non-empty queue of
:func:`~digen.core.policy.pull_order` + :func:`~digen.core.policy.idle_kinds`, as
``digen.workers.loop.next_task`` does). Its timeline rows carry the release and lease times the
runtime records, and :func:`digen.evaluation.eval_interference` (what ``digen bench``
reports) decides from them: no worker leases an ``eval`` task while a task it pulls first
waits, so a released generation task waits at most the remainder of one ``eval`` task."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field

import pytest

from digen.core.events import Finish, Release, Role, SetRole, Step, StepDone, TaskDone, TaskKind, WorkerJoined
from digen.core.policy import idle_kinds, pull_order
from digen.core.scheduler import Scheduler, SchedulerConfig
from digen.evaluation import eval_interference

GEN, TRAIN, EVAL = TaskKind.GEN, TaskKind.TRAIN, TaskKind.EVAL


@dataclass
class Harness:
    """Workers ``{name: role}`` with seconds per task ``{kind: s}`` (the same on each)."""

    workers: dict[str, Role]
    seconds: dict[TaskKind, float]
    step_s: float = 0.1
    scheduler: type[Scheduler] = Scheduler
    eval_first: bool = False
    """A broken pull order (``eval`` before everything): the checks must catch it."""
    now: float = 0.0
    queues: dict[TaskKind, deque] = field(default_factory=dict)
    idle: set[str] = field(default_factory=set)
    heap: list = field(default_factory=list)
    rows: list[dict] = field(default_factory=list)
    steps: dict[int, float] = field(default_factory=dict)
    """Iteration -> when its step was done."""
    finished: bool = False
    seq: itertools.count = field(default_factory=itertools.count)

    def run(self, cfg: SchedulerConfig) -> Harness:
        sched = self.scheduler(cfg)
        for name, role in self.workers.items():
            sched.handle(WorkerJoined(name, role, "cpu", 0.0))
        self.apply(sched.start(0.0))
        while self.heap and not self.finished:
            self.now, _, what = heapq.heappop(self.heap)
            if isinstance(what, StepDone):
                self.steps[what.iteration] = self.now
                self.apply(sched.handle(what))
            else:
                name, ref, start = what
                self.idle.add(name)
                self.apply(sched.handle(TaskDone(ref, name, start, self.now)))
        assert self.finished, "the run never finished"
        return self

    def apply(self, instructions) -> None:
        for ins in instructions:
            if isinstance(ins, Release):
                self.queues.setdefault(ins.task.kind, deque()).append((ins.task, self.now))
            elif isinstance(ins, SetRole):
                self.idle.add(ins.worker)
            elif isinstance(ins, Step):
                ev = StepDone(ins.iteration, self.now, self.now + self.step_s)
                heapq.heappush(self.heap, (self.now + self.step_s, next(self.seq), ev))
            elif isinstance(ins, Finish):
                self.finished = True
        self.dispatch()

    def order(self, role: Role) -> list[TaskKind]:
        kinds = pull_order(role, 0) + idle_kinds(role)
        return sorted(kinds, key=lambda k: k is not EVAL) if self.eval_first else kinds

    def dispatch(self) -> None:
        for name in sorted(self.idle):
            role = self.workers[name]
            kind = next((k for k in self.order(role) if self.queues.get(k)), None)
            if kind is None:
                continue
            ref, released = self.queues[kind].popleft()
            self.idle.discard(name)
            end = self.now + self.seconds[kind]
            self.rows.append(
                {
                    "task": ref.id,
                    "kind": kind.value,
                    "worker": name,
                    "role": role.value,
                    "iteration": ref.iteration,
                    "released": released,
                    "leased": self.now,
                    "start": self.now,
                    "end": end,
                }
            )
            heapq.heappush(self.heap, (end, next(self.seq), (name, ref, self.now)))


DIGEN = {"gap": True, "max_staleness": 1}
TRAIN_BOUND = {GEN: 1.0, TRAIN: 1.6, EVAL: 0.7}
"""Two rollout workers generate 4 groups in 2 s, one trainer trains them in 6.4 s: bubbles."""
GEN_BOUND = {GEN: 2.0, TRAIN: 0.3, EVAL: 0.7}
ROLES = {"r0": Role.ROLLOUT, "r1": Role.ROLLOUT, "t0": Role.TRAINER}


def run(seconds, workers=ROLES, eval_every=1, eval_tasks=3, iterations=5, **kw) -> Harness:
    mode = {**DIGEN, **kw.pop("mode", {})}
    cfg = SchedulerConfig(iterations, 4, eval_every=eval_every, eval_tasks=eval_tasks, **mode)
    return Harness(dict(workers), seconds, **kw).run(cfg)


def evaluations(h: Harness) -> set[int]:
    return {r["iteration"] for r in h.rows if r["kind"] == "eval"}


def test_training_bound_digen_evaluates_in_the_bubbles_without_overtaking():
    h = run(TRAIN_BOUND)
    cost = eval_interference(h.rows)
    assert evaluations(h) == {0, 1, 2, 3, 4}  # every evaluation ran
    assert cost["eval_overtakes"] == 0
    assert cost["eval_max_wait_s"] <= cost["eval_max_task_s"] == pytest.approx(0.7)
    assert cost["eval_busy_s"] == pytest.approx(5 * 3 * 0.7)
    assert cost["eval_in_bubbles_s"] > 0
    # the steps (the critical path: the trainer) are those of the run without evaluation
    base = run(TRAIN_BOUND, eval_every=0)
    assert h.steps == pytest.approx(base.steps)


def test_generation_bound_digen_defers_evaluation_and_keeps_every_step_time():
    h = run(GEN_BOUND)
    cost = eval_interference(h.rows)
    assert cost["eval_overtakes"] == 0 and cost["eval_wait_s"] == 0  # nothing ever waited on eval
    assert cost["eval_outside_bubbles_s"] == 0
    assert h.steps == run(GEN_BOUND, eval_every=0).steps
    last_gen = max(r["end"] for r in h.rows if r["kind"] == "gen")
    first_eval = min(r["start"] for r in h.rows if r["kind"] == "eval")
    assert first_eval >= last_gen  # no bubble before the end: evaluations wait for it


def test_a_gen_release_during_an_eval_task_waits_only_its_remainder():
    # one rollout worker, long evaluation tasks: the step of iteration k releases generation
    # of k + 2 while the worker evaluates; it waits for that task, never for the next chunk
    h = run(TRAIN_BOUND, workers={"r0": Role.ROLLOUT, "t0": Role.TRAINER}, eval_tasks=4)
    cost = eval_interference(h.rows)
    assert cost["eval_overtakes"] == 0
    assert 0 < cost["eval_max_wait_s"] <= cost["eval_max_task_s"]
    assert cost["eval_outside_bubbles_s"] > 0  # ... and the trainer, the bottleneck, never waited:
    assert h.steps == pytest.approx(
        run(TRAIN_BOUND, workers={"r0": Role.ROLLOUT, "t0": Role.TRAINER}, eval_every=0).steps
    )


def test_colocated_workers_evaluate_only_once_generation_and_training_are_done():
    workers = {"c0": Role.COLOCATED, "c1": Role.COLOCATED}
    h = run(TRAIN_BOUND, workers=workers, mode={"gap": False, "max_staleness": 0})
    cost = eval_interference(h.rows)
    assert evaluations(h) == {0, 1, 2, 3, 4} and cost["eval_overtakes"] == 0
    assert cost["eval_max_wait_s"] <= cost["eval_max_task_s"]


class AllAtOnce(Scheduler):
    """Releases a whole evaluation at once (no cap on ``eval`` tasks in flight)."""

    def _evaluators(self) -> int:
        return 1_000


def test_the_checks_catch_a_pull_order_that_puts_eval_first():
    one = {"r0": Role.ROLLOUT, "t0": Role.TRAINER}
    h = run(TRAIN_BOUND, workers=one, eval_tasks=4, scheduler=AllAtOnce, eval_first=True)
    cost = eval_interference(h.rows)
    assert cost["eval_overtakes"] > 0
    assert cost["eval_max_wait_s"] > cost["eval_max_task_s"]  # it waited for several chunks


def test_a_whole_evaluation_released_at_once_holds_colocated_training_up_more():
    # all chunks out at once: a colocated worker that finishes a generation task while its
    # peer still generates finds a leftover chunk, and the training released a moment later
    # waits for it; one chunk per worker in flight leaves none behind
    workers = {"c0": Role.COLOCATED, "c1": Role.COLOCATED}
    mode = {"gap": False, "max_staleness": 0}
    capped = run(TRAIN_BOUND, workers=workers, mode=mode)
    loose = run(TRAIN_BOUND, workers=workers, mode=mode, scheduler=AllAtOnce)
    assert eval_interference(loose.rows)["eval_wait_s"] > eval_interference(capped.rows)["eval_wait_s"]
    assert loose.steps[4] > capped.steps[4]
