"""Carrying out the scheduler's instructions in Redis: tasks into their queues, role tags.

:class:`Dispatcher` turns a :class:`~digen.core.events.Release` into a task in its queue with
its payload (a generation task's group and version; a reward task's group; a train task's
spec, prompt and trajectories' ``source``, and for a task of several groups,
``train.groups_per_task``, the same three for each further group in ``batch``; an ``eval``
chunk), a :class:`~digen.core.events.SetRole` into the worker's tag, a
:class:`~digen.core.events.RequeueWorker` into its leases going back to their queues. A task
released again (its input or its result was lost) is re-posted: run anew with its payload.
After a Redis outage it writes again what a restarted server may have lost.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from digen.controlplane.jobstate import JobState
from digen.controlplane.messages import BlobRef
from digen.controlplane.payloads import (
    GenPayload,
    Payload,
    RewardPayload,
    TrainEntry,
    TrainPayload,
    with_sources,
)
from digen.controlplane.queue import TaskQueue
from digen.core.events import Release, Role, TaskDone, TaskKind, TaskRef
from digen.errors import ConnectionFailure
from digen.iteration import draws_grid
from digen.rundir import checkpoint_advice
from digen.runtime.evals import Evaluations
from digen.runtime.ledger import Ledger
from digen.task_records import TrainStats

log = logging.getLogger(__name__)


@dataclass
class Dispatcher:
    ledger: Ledger
    queue: TaskQueue
    job: JobState
    reward_tasks: bool = False
    """Scoring runs as ``reward`` tasks (generation tasks keep the decoded images for them)."""
    evals: Evaluations | None = None
    run_root: str = ""
    """The run directory (named in a message when Redis lost the job's data)."""
    tags: dict[str, tuple[Role, int]] = field(default_factory=dict)
    held: list[tuple[TaskRef, str, Payload]] | None = None
    """Generation tasks released inside :meth:`together`, put when it ends."""

    @contextmanager
    def together(self) -> Iterator[None]:
        """Generation tasks released inside go into their queue together when the block ends,
        in one round trip: a rollout worker woken by the first of an iteration's groups finds
        the others queued and leases them as one batch (``rollout.max_batch``)."""
        if self.held is not None:  # inside an outer block: its end puts them
            yield
            return
        self.held = []
        try:
            yield
        finally:
            held, self.held = self.held, None
            self._put_held(held)

    def _put_held(self, held: list[tuple[TaskRef, str, Payload]]) -> None:
        if not held:
            return
        new = self.queue.put_all([(queue, t.id, payload.to_json()) for t, queue, payload in held])
        for (t, queue, payload), fresh in zip(held, new, strict=True):
            self._after_put(t, queue, payload, fresh)

    def set_role(self, worker: str, role: Role, budget: int) -> None:
        self.tags[worker] = (role, budget)
        self.job.set_tag(worker, role, budget)
        self.queue.wake(worker)  # an idle worker reads its new tag now

    def requeue_worker(self, worker: str) -> None:
        lost = self.queue.requeue_worker(worker)
        if lost:
            log.warning("worker %s left; re-queued %s", worker, lost)

    def release(self, ins: Release) -> TaskDone | None:
        """Queue a task. A train task with no sample left (every reward NaN, or its generation
        task dead) is settled here: the returned :class:`TaskDone` tells the scheduler."""
        t, led = ins.task, self.ledger
        if t.kind is TaskKind.EVAL:
            assert self.evals is not None
            self.put(t, "eval", self.evals.payload(t))
            return None
        book = led.book(t.iteration)
        if t.kind is TaskKind.GEN:
            task = book.groups[t.group]
            assert task.version == ins.version, (task.version, ins.version)
            self.put(t, "gen", GenPayload(task, not self.reward_tasks, draws_grid(led.cfg, t.iteration)))
            return None
        if t.kind is TaskKind.REWARD:
            if led.gen_id(t.iteration, t.group) in led.dead.get(t.iteration, []):
                return TaskDone(t, "", time.time(), time.time())  # NaN rewards already
            self.put(t, "reward", RewardPayload(book.groups[t.group], self.source(t)))
            return None
        specs = book.task_specs(t.group, t.part)  # one per group (train.groups_per_task)
        if not any(x.samples for x in specs):  # nothing to train: settled with a zero gradient (nothing sent)
            book.stats.setdefault((t.group, t.part or 0), TrainStats())
            led.collected.add(t.id)
            return TaskDone(t, "", time.time(), time.time())
        tsp = bool(led.cfg.schedule.resolved().tsp)
        first = book.groups[t.group]
        batch = tuple(  # a batched task (train.groups_per_task): its further groups, in group order
            TrainEntry(x, book.groups[x.group].prompt, self.group_source(t.iteration, x.group))
            for x in specs[1:]
        )
        keep = led.cfg.train.exact_sum  # the step sums the blobs in task order
        payload = TrainPayload(
            specs[0], ins.version, first.prompt, tsp, self.source(t), batch, keep_gradient=keep
        )
        self.put(t, "train", payload)
        led.train_released.setdefault(t.iteration, set()).add(t.id)
        return None

    def source(self, t: TaskRef) -> BlobRef | None:
        """Where the trajectories of ``t``'s group are (the worker fetches them from there;
        None: being generated again, the task will be re-posted with it), their digest and the
        version they were generated with (the worker checks what it fetched against both)."""
        return self.group_source(t.iteration, t.group)

    def group_source(self, iteration: int, group: int) -> BlobRef | None:
        """:meth:`source` of one group."""
        b = self.ledger.sources.get(iteration, {}).get(group)
        if b is None:
            return None
        version = self.ledger.gen_versions.get(iteration, {}).get(group)
        return replace(b, version=None if version is None else int(version))

    def put(self, t: TaskRef, queue: str, payload: Payload) -> None:
        """Queue ``t``; one that exists (released again: its input or result was lost) runs anew."""
        self.ledger.outstanding[t.id] = (queue, payload)
        if self.held is not None and queue == "gen":
            self.held.append((t, queue, payload))
            return
        self._after_put(t, queue, payload, self.queue.put(queue, t.id, payload.to_json()))

    def _after_put(self, t: TaskRef, queue: str, payload: Payload, fresh: bool) -> None:
        led = self.ledger
        if not fresh:
            state = self.queue.repost(queue, t.id, payload.to_json())
            log.info("task %s released again (it was %s)", t.id, state)
            led.collected.discard(t.id)
        led.released_at.setdefault(t.id, time.time())  # after the put: a later lease saw it queued

    def repost_parked(self, iteration: int, group: int) -> None:
        """The group's trajectories exist (again): run the tasks that waited for them, with
        where they are now (a batched train task once none of its groups is being generated
        again: it stays parked on those)."""
        led = self.ledger
        for tid in sorted(led.parked.pop((iteration, group), set())):
            queue, payload = led.outstanding.get(tid, (None, None))
            if queue is None or payload is None:
                continue
            ref = TaskRef.parse(tid)
            groups = self.groups_of(ref)
            if any((iteration, g) in led.parked and tid in led.parked[(iteration, g)] for g in groups):
                continue  # another of its groups is still being generated again
            payload = with_sources(payload, [self.group_source(iteration, g) for g in groups])
            led.outstanding[tid] = (queue, payload)
            self.queue.repost(queue, tid, payload.to_json())

    def groups_of(self, ref: TaskRef) -> list[int]:
        """The groups whose trajectories task ``ref`` reads (a batched train task's: several)."""
        if ref.kind is TaskKind.TRAIN and ref.iteration in self.ledger.books:
            return list(self.ledger.books[ref.iteration].task_groups(ref.group))
        return [ref.group]

    def reconcile(self) -> list[str]:
        """After a Redis outage: write again what a restarted server may have lost (with
        ``appendfsync everysec``, up to its last second of writes): the job's status, role
        tags, released tasks. Every write is idempotent. Returns the tasks found done (to
        collect with the next done ids)."""
        log.warning("job %s: Redis was unreachable; checking the job's keys", self.job.job_id)
        if self.job.status() is None:  # written at the start and never deleted while the job runs
            raise ConnectionFailure(
                f"Redis lost the job's data (restarted without persistence); {checkpoint_advice(Path(self.run_root))}"
            )
        for worker, (role, budget) in self.tags.items():
            if self.job.tag(worker) is None:
                self.job.set_tag(worker, role, budget)
        done = []
        for tid, (queue, payload) in list(self.ledger.outstanding.items()):
            state = self.queue.state(tid)
            if state is None:
                log.warning("task %s was lost with Redis; queuing it again", tid)
                self.queue.put(queue, tid, payload.to_json())
            elif state == "done":
                done.append(tid)
        return done
