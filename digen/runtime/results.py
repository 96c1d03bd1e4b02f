"""Results coming back: acknowledged tasks, dead ones, parked ones, and what left with a worker.

:class:`Collector` counts each acknowledged task once into the :class:`~digen.runtime.ledger.Ledger`
(a generation task's rewards and where its trajectories are; a train task's stats and who
holds its gradient; an ``eval`` chunk's scores and cells), each read as its record
(:mod:`digen.controlplane.messages`): a stored result that does not read is quarantined as
junk and its task runs again and answers with the scheduler
events that follow. It also settles what did not come back as planned:

- a task that failed ``schedule.max_attempts`` times (a dead letter): the job fails, or with
  ``schedule.on_poison: drop`` its samples are dropped;
- a task parked because its input is gone (:meth:`~digen.controlplane.queue.TaskQueue.park`): its
  group is generated again (:class:`~digen.core.events.GroupLost`), and the task re-posted
  once it is;
- a worker that left: the groups whose trajectories only it held are generated again, and the
  train tasks whose gradients it held (not yet counted by a step) run again
  (:class:`~digen.core.events.TrainLost`). At-least-once delivery, exactly-once effect.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

from digen.controlplane.messages import (
    EvalChunkResult,
    GenResult,
    Result,
    RewardResult,
    TrainResult,
    result_type,
)
from digen.controlplane.queue import DeadLetter, TaskQueue, is_step_id
from digen.core.events import Event, GroupLost, TaskDone, TaskKind, TaskRef, TrainLost
from digen.core.timeline import TimelineRow
from digen.errors import DigenError, PayloadError
from digen.rundir import RunDir
from digen.runtime.dispatch import Dispatcher
from digen.runtime.evals import Evaluations
from digen.runtime.ledger import Ledger, Trained
from digen.task_records import TrainStats

log = logging.getLogger(__name__)


class PoisonTask(DigenError):
    """A task that failed ``schedule.max_attempts`` times, with ``schedule.on_poison: fail``."""


@dataclass
class Collector:
    ledger: Ledger
    queue: TaskQueue
    run: RunDir
    dispatch: Dispatcher
    evals: Evaluations | None = None
    dead_seen: set[str] = field(default_factory=set)

    # --- acknowledged -----------------------------------------------------------------------
    def read(self, task_id: str, raw: object) -> Result | None:
        """The result of ``task_id`` as its record (:func:`~digen.controlplane.messages.result_type`);
        None when there is none, or
        when what is stored does not read: junk, quarantined (recorded and counted as the
        queue's own junk) and, for a task the controller still waits for, run again (a step's
        acknowledgement: asked for again by its step group, :meth:`~digen.runtime.steps.StepGroup.ask_again`)."""
        if raw is None:
            return None
        try:
            return result_type(task_id).read(raw)
        except PayloadError as err:
            self.queue.quarantine(f"result:{task_id}", raw, f"the stored result of task {task_id}: {err}")
            queue, payload = self.ledger.outstanding.get(task_id, ("", None))
            if payload is not None and not is_step_id(
                task_id
            ):  # a step: its group asks again (applied: never twice)
                log.warning("task %s runs again: its stored result does not read", task_id)
                self.queue.repost(queue, task_id, payload.to_json())
            return None

    def collect(self, task_id: str, res: Result | None) -> list[Event]:
        """Count an acknowledged task's result ``res`` (read with :meth:`read`; once); the
        scheduler events it makes."""
        led = self.ledger
        if task_id in led.collected:
            return []
        ref = TaskRef.parse(task_id)
        if isinstance(res, EvalChunkResult) and ref.kind is TaskKind.EVAL:
            return self.collect_eval(ref, res)
        if res is None or ref.iteration not in led.books:
            return []
        if isinstance(res, TrainResult) and self.from_a_past_incarnation(task_id, res):
            return []
        led.collected.add(task_id)
        led.outstanding.pop(task_id, None)
        book = led.books[ref.iteration]
        led.events += self.stamp(task_id, res.events)
        if isinstance(res, GenResult):
            if not self.dispatch.reward_tasks:
                book.add_rewards(ref.group, res.rewards, res.reward_parts)
            led.sources.setdefault(ref.iteration, {})[ref.group] = replace(res.blob, worker=res.worker)
            led.gen_versions.setdefault(ref.iteration, {})[ref.group] = book.groups[ref.group].version
            if res.cells is not None:
                led.cells.setdefault(ref.iteration, {})[ref.group] = res.cells
            if (ref.iteration, ref.group) in led.regenerating:
                led.regenerating.discard((ref.iteration, ref.group))
                self.dispatch.repost_parked(ref.iteration, ref.group)
        elif isinstance(res, RewardResult):
            book.add_rewards(ref.group, res.rewards, res.reward_parts)
        elif isinstance(res, TrainResult):
            blob = None if res.grad is None else replace(res.grad, worker=res.worker)
            led.trained.setdefault(ref.iteration, {})[task_id] = Trained(ref, res.worker, blob)
            book.stats[(ref.group, ref.part or 0)] = res.stats
        return [TaskDone(ref, res.worker, res.start, res.end)]

    def from_a_past_incarnation(self, task_id: str, res: TrainResult) -> bool:
        """A train result acknowledged by a worker process that is gone since (its name is
        back as a new incarnation, which does not hold that gradient): not counted; the task
        runs again (it is still outstanding, the scheduler still waits for it)."""
        made_by, worker = res.incarnation, res.worker
        if not made_by or self.dispatch.job.incarnations([worker]).get(worker, made_by) == made_by:
            return False
        log.warning(
            "train task %s was acknowledged by %s before it restarted; it runs again", task_id, worker
        )
        queue, payload = self.ledger.outstanding.get(task_id, ("train", None))
        if payload is not None:
            self.queue.repost(queue, task_id, payload.to_json())
        return True

    def stamp(self, task_id: str, events: list[TimelineRow]) -> list[dict]:
        """A collected task's timeline rows as written, marked with its id (``task``) and
        release time."""
        released = self.ledger.released_at.pop(task_id, None)
        for e in events:
            e.task = task_id
            if released is not None:
                e.released = released
        return [e.to_json() for e in events]

    def collect_eval(self, ref: TaskRef, res: EvalChunkResult) -> list[Event]:
        """An ``eval`` task's scores and cells; its evaluation's timeline rows are written
        when it completes (an evaluation runs after its iteration's rows are out)."""
        if self.evals is None or not self.evals.pending(ref):
            return []
        self.ledger.collected.add(ref.id)
        self.ledger.outstanding.pop(ref.id, None)
        self.run.append("timeline.jsonl", self.evals.collect(ref, res, self.stamp(ref.id, res.events)))
        return [TaskDone(ref, res.worker, res.start, res.end)]

    # --- parked and lost --------------------------------------------------------------------
    def parked(self, task_id: str, why: str, now: float) -> list[Event]:
        """A task gave its lease back because its group's trajectories are gone: generate the
        group again (once), then re-post every task parked on it. A batched train task
        (``train.groups_per_task``) does not say which of its groups it missed: all of them
        are generated again (the same seeds make the same trajectories; a failure path only)."""
        ref = TaskRef.parse(task_id)
        led = self.ledger
        if ref.iteration not in led.books:
            return []
        out: list[Event] = []
        for g in self.dispatch.groups_of(ref):
            led.parked.setdefault((ref.iteration, g), set()).add(task_id)
            log.warning(
                "task %s lost its input (%s); generating group %d of iteration %d again",
                task_id,
                why,
                g,
                ref.iteration,
            )
            out += self.regenerate(ref.iteration, g, now)
        return out

    def regenerate(self, iteration: int, group: int, now: float) -> list[Event]:
        led = self.ledger
        if (iteration, group) in led.regenerating:
            return []
        led.regenerating.add((iteration, group))
        led.sources.get(iteration, {}).pop(group, None)
        led.collected.discard(led.gen_id(iteration, group))
        return [GroupLost(iteration, group, now)]

    def worker_left(
        self, worker: str, now: float, keep: frozenset[str] | set[str] = frozenset()
    ) -> list[Event]:
        """Regenerate what only ``worker`` held and train again what it had trained, but for
        the train tasks in ``keep`` (the step in flight's: its decision says whether they are
        lost, :meth:`~digen.runtime.steps.StepControl.check`)."""
        groups, tasks = self.ledger.held_on(worker, keep)
        out: list[Event] = []
        for k, g in groups:
            log.warning("worker %s left with the trajectories of group %d of iteration %d", worker, g, k)
            out += self.regenerate(k, g, now)
        for k, refs in tasks.items():
            out += self.train_again(k, refs, now, f"worker {worker} left with their gradients")
        return out

    def train_again(self, iteration: int, refs: list[TaskRef], now: float, why: str) -> list[Event]:
        if not refs:
            return []
        log.warning("train tasks %s run again: %s", ", ".join(r.id for r in refs), why)
        self.ledger.untrain(iteration, refs)
        return [TrainLost(iteration, tuple((r.group, r.part) for r in refs), now)]

    # --- dead letters -----------------------------------------------------------------------
    def poisoned(self, dead: DeadLetter, group_error=None) -> list[Event]:
        """A task that failed ``schedule.max_attempts`` times (its error is in
        ``dead_letters.jsonl``): fail the job, or (``on_poison: drop``) drop its samples: a dead
        generation task's samples count as dropped (NaN rewards) and its group trains nothing;
        a dead train task's group adds nothing to the step and its samples do not count.
        ``group_error(dead)``: the error the trainer group raises for a dead train task or step
        command, or None (:meth:`~digen.runtime.steps.StepGroup.dead_task`)."""
        if dead.task_id in self.dead_seen:
            return []
        self.dead_seen.add(dead.task_id)
        led = self.ledger
        led.released_at.pop(dead.task_id, None)
        action = led.cfg.schedule.on_poison
        first = (dead.error.strip().splitlines() or ["no error recorded"])[0]
        self.run.append(
            "dead_letters.jsonl",
            [
                {
                    "task": dead.task_id,
                    "queue": dead.queue,
                    "attempts": dead.attempts,
                    "error": dead.error,
                    "action": action,
                    "time": time.time(),
                }
            ],
        )
        if group_error is not None and (is_step_id(dead.task_id) or dead.queue == TaskKind.TRAIN.value):
            err = group_error(dead)
            if err is not None:
                raise err
        if is_step_id(dead.task_id):
            return []
        if "RewardServiceDown" in first:  # not this task's fault: no task would score
            raise PoisonTask(f"task {dead.task_id} failed: {first.split(': ', 1)[-1]}")
        ref = TaskRef.parse(dead.task_id)
        if ref.kind is not TaskKind.EVAL and (
            dead.task_id in led.collected or ref.iteration not in led.books
        ):
            # its result counted already, or its iteration is finished: nothing waits for it
            log.info(
                "task %s is dead after %d attempt(s) (%s); nothing needs it any more",
                dead.task_id,
                dead.attempts,
                first,
            )
            return []
        if action == "fail":
            raise PoisonTask(
                f"task {dead.task_id} failed {dead.attempts} time(s): {first}; fix the cause and rerun "
                f"with --resume, or set schedule.on_poison=drop to drop such samples"
            )
        if ref.kind is TaskKind.EVAL and self.evals is not None and self.evals.pending(ref):
            led.outstanding.pop(dead.task_id, None)
            self.run.append("timeline.jsonl", self.evals.drop(ref))
            return [TaskDone(ref, "", time.time(), time.time())]
        log.warning(
            "task %s is dead after %d attempt(s) (%s); its samples are dropped (schedule.on_poison: drop)",
            dead.task_id,
            dead.attempts,
            first,
        )
        led.collected.add(dead.task_id)
        led.outstanding.pop(dead.task_id, None)
        led.dead.setdefault(ref.iteration, []).append(dead.task_id)
        book = led.books[ref.iteration]
        if ref.kind in (TaskKind.GEN, TaskKind.REWARD):
            book.add_rewards(ref.group, [float("nan")] * led.cfg.rollout.group_size)
        else:
            led.untrained.setdefault(ref.iteration, set()).add((ref.group, ref.part))
            book.stats.setdefault((ref.group, ref.part or 0), TrainStats())
        return [TaskDone(ref, "", time.time(), time.time())]
