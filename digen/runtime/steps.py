"""The controller's side of the optimizer steps: ask the trainer group, watch, settle.

When every train task of an iteration is done, the scheduler says :class:`~digen.core.events.Step`.
:class:`StepControl` then writes a step command for the trainer group
(:class:`~digen.controlplane.trainer_group.StepCommand`: the members and their epoch, the version
the step starts from, the rows to divide by, which member holds which task's gradient in its
running sum and which gradients are blobs, where to stage the checkpoint) and puts the step's
task id (``step:<iteration>``) in the ``step`` queue, where the writer acknowledges it.

While the step runs it watches (:meth:`StepControl.check`): a member that leaves before the
commit aborts the step (the decision key is written once, so the members apply it all or
none); an aborted step's gradients are gone with the members' sums, so its train tasks run
again (the scheduler asks for the step anew once they are done, in a new epoch); a writer that
leaves after the commit is replaced by another member, which holds the same state. The
acknowledgement (:meth:`StepControl.collect`) gives the new version, its grad norm and the
staged checkpoint. One that does not read (junk in Redis, quarantined) is asked for again
(:meth:`StepControl.ask_again`): the members applied the step, so the writer acknowledges it
again from what it holds; never a second step, and never a job that waits for ever.

**The step invariant.** A step's command lists exactly the train tasks of its iteration's
mini-batch that were released (less those dead under ``schedule.on_poison: drop``), each one
with the member whose running sum holds its gradient or the blob that holds it; it is issued
only when every one of them is held, and its rows are those tasks' rows.
:meth:`StepControl.request` checks this before it writes the command and fails the job naming
the task otherwise (:class:`~digen.errors.DigenError`): it never trains on without it. Three
rules keep it true whatever the interleaving of deaths, aborts and re-released tasks:

- a worker that leaves while a step is in flight does not take that step's tasks out of the
  ledger (:meth:`StepControl.worker_left` remembers it): the step's decision says what is lost
  (abort: the members' sums, and the blobs of every worker that left; commit: nothing);
- after an abort the step is asked for again at once only if nothing was lost; otherwise the
  scheduler asks for it once the tasks run again are done (never the controller by itself);
- members are incarnations, not names: a trainer restarted under its old name left (what it
  held is gone) and joined as a new member, so the next step forms a new epoch.

The books follow the committed steps (:attr:`~digen.runtime.ledger.Ledger.committed`): an
iteration's trained rows are its committed tasks' rows; a released task that no committed step
holds (impossible while the invariant holds) is counted as dropped, with a warning.

The controller never holds a gradient or a weight: everything above is names and addresses.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from digen.config import Config
from digen.controlplane.messages import StepAck, TaskBlob
from digen.controlplane.payloads import StepPayload
from digen.controlplane.queue import STEP_QUEUE, DeadLetter, TaskQueue, step_id
from digen.controlplane.trainer_group import ABORT, COMMIT, StepCommand, TrainerGroup
from digen.core import versions
from digen.core.events import TaskRef
from digen.errors import DigenError
from digen.iteration import checkpoints
from digen.rundir import RunDir
from digen.runtime.ledger import Ledger

if TYPE_CHECKING:
    from digen.runtime.membership import Membership

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    """An acknowledged step: its iteration and mini-batch, the version after it, its numbers."""

    iteration: int
    version: int
    stats: dict
    events: list[dict]
    checkpoint: str | None
    asked: float
    """When the step was asked for (controller clock)."""
    mini_batch: int = 0
    last_of_iteration: bool = True
    rows: int = 0
    """The rows the step divided by (its tasks' rows)."""
    tasks: list[str] = field(default_factory=list)
    """The train tasks whose gradients the step summed."""


Hold = Callable[[int], int]
"""Given the oldest version the trainers would keep serving, the oldest they must: generation
not yet done may load an older one (an iteration still generating while its first mini-batch
steps, a lost group generated again), and so may an evaluation still waiting for its version
(:meth:`digen.runtime.controller.Controller.oldest_needed`)."""


class StepGroup(Protocol):
    """The trainer group as the controller drives it, whichever its kind: the replicated group
    (:class:`StepControl`: every member holds the whole optimizer; members come and go) or the
    FSDP group (:class:`~digen.runtime.fsdp_group.FsdpControl`: the ranks hold shards; fixed
    at job start). The controller asks it for each optimizer step and collects the result;
    what differs between the kinds is behind these methods, never a branch in the controller."""

    def ask(self, iteration: int, mini_batch: int, members: Membership, hold: Hold | None) -> bool:
        """Ask for the step of ``iteration``'s mini-batch ``mini_batch``; False while it waits
        for a member to be there (the controller asks again at its next look)."""
        ...

    def collect(self, task_id: str, res: StepAck | None) -> StepResult | None:
        """The acknowledged step command ``task_id`` (None: not one this group waits for)."""
        ...

    def makes_version(self, task_id: str) -> int | None:
        """The version step ``task_id`` makes (the one its acknowledgement must name), None
        when it is not a step this group waits for."""
        ...

    def ask_again(self, task_id: str) -> None:
        """The stored acknowledgement of step ``task_id`` did not read (junk, quarantined): if
        it is the step this group waits for, have the group acknowledge it again (its members
        applied it already: they answer from what they hold, never stepping twice). Raises
        :class:`DigenError` naming the step once ``schedule.max_attempts`` acknowledgements of
        it did not read (:func:`count_junk_ack`)."""
        ...

    def settle_departure(self, worker: str) -> set[str] | None:
        """``worker`` left: the train tasks whose gradients the step in flight settles (the
        rest of what it held is lost with it), or None when the group settles a departure
        itself (the FSDP group fails the job)."""
        ...

    def settle(self, iteration: int) -> list[str]:
        """At the end of ``iteration``: its train tasks in no committed step (dropped)."""
        ...

    def checkpoint_placed(self, folder: str | None) -> None: ...

    def look(self, members: Membership) -> None:
        """The controller's periodic look: raise when the group cannot continue."""
        ...

    def watch(self, alive: Callable[[], dict[str, str]]) -> tuple[int, int, list[TaskRef]] | None:
        """The step in flight was aborted: (its iteration, its mini-batch, the train tasks to
        run again); ``alive()``: the workers there -> their loop's incarnation."""
        ...

    def reconcile(self) -> None:
        """After a Redis outage: write again the group's keys a restarted server may have lost."""
        ...

    def dead_task(self, dead: DeadLetter) -> Exception | None:
        """The error that ends the job for a dead train task or step command (None: the task
        is settled as any other, ``schedule.on_poison``)."""
        ...


@dataclass
class StepControl:
    """The replicated trainer group's :class:`StepGroup`."""

    cfg: Config
    run: RunDir
    queue: TaskQueue
    group: TrainerGroup
    ledger: Ledger
    version: int
    """The newest committed version."""
    checkpoint: str | None = None
    """The newest checkpoint in place (a member that finds no peer holding the state starts from it)."""
    epoch: int = 0
    members: list[str] = field(default_factory=list)
    """The member list of the current epoch."""
    incarnations: dict[str, str] = field(default_factory=dict)
    """member -> incarnation of the current epoch (a restart is a new member: a new epoch)."""
    departed: set[str] = field(default_factory=set)
    """Workers that left while the step in flight ran (a member, or a worker holding one of its
    gradients as a blob): what they held is gone even if a worker of that name is back."""
    aborts: list[dict] = field(default_factory=list)
    """Every aborted step: {"step", "epoch", "gone", "lost", "why"} (for tests and the log)."""
    inflight: StepCommand | None = None
    asked: float = 0.0
    keep_from: int | None = None
    """Members keep serving every version from this one on (an evaluation still to run)."""
    failed_aborts: dict[str, int] = field(default_factory=dict)
    """step id -> aborts in a row that no departure explains (a member failed by itself)."""
    junk_acks: dict[str, int] = field(default_factory=dict)
    """step id -> its acknowledgements that did not read (:meth:`ask_again`)."""

    @property
    def mini_batches(self) -> int:
        return self.cfg.train.mini_batches

    def keep_version(self, iteration: int) -> int | None:
        """Staleness 1: the version iteration ``iteration`` generated with, which the next
        iteration's rollouts may still use while its steps run (None at staleness 0)."""
        return versions.kept_version(iteration, self.mini_batches, self.cfg.schedule.resolved().max_staleness)

    def publish_current(self) -> None:
        """Tell joining members which state to start from (and which older version to keep)."""
        iteration = versions.iteration_of(self.version, self.mini_batches)
        keep = self.keep_version(max(iteration, 0)) if self.version else None
        self.group.set_current(self.version, self.checkpoint, keep)

    # --- asking -----------------------------------------------------------------------------
    def request(
        self,
        iteration: int,
        members: list[str],
        mini_batch: int = 0,
        incarnations: dict[str, str] | None = None,
    ) -> bool:
        """Ask the trainer group for the step of ``iteration``'s mini-batch ``mini_batch``
        (``incarnations``: member -> the token of its loop); False (ask again later) when no
        member is there to take it. Raises :class:`DigenError` when the step's tasks are not
        all held (see the module docstring: the step invariant)."""
        if not members:
            return False
        step = step_id(iteration, mini_batch, self.mini_batches)
        if self.inflight is not None:
            raise DigenError(
                f"the optimizer step {step} was asked for while {self.inflight.id} (epoch {self.inflight.epoch}) "
                f"is in flight; this is a bug in digen: rerun with --resume to continue from the last checkpoint"
            )
        book = self.ledger.books[iteration]
        book.trained_rows(mini_batch)  # no row at all: the reward's error, naming why
        trained = self.held_tasks(iteration, mini_batch, step)
        rows = sum(book.stats[(t.task.group, t.task.part or 0)].rows for t in trained.values())
        exact = self.cfg.train.exact_sum
        order = sorted(trained.values(), key=lambda t: (t.task.group, t.task.part or 0))
        blobs = [TaskBlob(t.task.id, t.blob) for t in order if t.blob is not None]
        held: dict[str, list[str]] = {}
        for t in order:
            if t.blob is None:
                held.setdefault(t.worker, []).append(t.task.id)
        known = incarnations or {}
        incarnations = {m: known[m] for m in members if m in known}
        if members != self.members or incarnations != self.incarnations:
            self.epoch, self.members, self.incarnations = self.epoch + 1, list(members), incarnations
        last = mini_batch == self.mini_batches - 1
        folder = None
        if last and checkpoints(self.cfg, iteration):
            folder = str(self.run.checkpoint_dir(iteration).resolve())
        cmd = StepCommand(
            id=step,
            iteration=iteration,
            epoch=self.epoch,
            members=self.members,
            version=self.version,
            rows=rows,
            held=held,
            blobs=blobs,
            exact=exact,
            writer=self.members[0],
            checkpoint=folder,
            keep_checkpoints=self.cfg.output.keep_checkpoints,
            mini_batch=mini_batch,
            last_of_iteration=last,
            keep_version=self.keep_version(iteration),
            serve_from=self.keep_from,
            restore=self.checkpoint,
            incarnations=dict(self.incarnations),
        )
        self.group.forget_step(cmd.id)
        payload = StepPayload(iteration, mini_batch)
        if not self.queue.put(STEP_QUEUE, cmd.id, payload.to_json()):
            self.queue.repost(STEP_QUEUE, cmd.id, payload.to_json())
        self.ledger.outstanding[cmd.id] = (STEP_QUEUE, payload)
        self.group.set_step(cmd)
        self.queue.wake(*cmd.members)
        self.inflight, self.asked = cmd, time.time()
        self.departed = set()
        return True

    def held_tasks(self, iteration: int, mini_batch: int, step: str) -> dict:
        """The ledger's trained tasks of the mini-batch (id -> :class:`Trained`), checked to be
        exactly its released train tasks less the dead ones (:class:`DigenError` naming the
        task otherwise: the step invariant)."""
        led = self.ledger
        book = led.books[iteration]
        trained = {
            k: t
            for k, t in led.trained.get(iteration, {}).items()
            if book.task_mini_batch(t.task.group, t.task.part) == mini_batch
        }
        dead = set(led.dead.get(iteration, []))
        want = {
            tid
            for tid in led.train_released.get(iteration, set())
            if book.task_mini_batch(*_group_part(tid)) == mini_batch and tid not in dead
        }
        missing, extra = sorted(want - trained.keys()), sorted(trained.keys() - want)
        if missing or extra:
            what = [f"train task {t} (no member holds its gradient)" for t in missing]
            what += [f"train task {t} (never released for it)" for t in extra]
            raise DigenError(
                f"the optimizer step {step} would leave out or add {', '.join(what)}: a step sums every train "
                f"task of its mini-batch or none; this is a bug in digen: rerun with --resume to continue from "
                f"the last checkpoint"
            )
        return trained

    def worker_left(self, worker: str) -> None:
        """``worker`` left: what it held for the step in flight is gone (see :meth:`check`)."""
        if self.inflight is not None:
            self.departed.add(worker)

    def in_flight_tasks(self) -> set[str]:
        """The train tasks of the step in flight (a departure does not take them out of the
        ledger: the step's decision says what is lost)."""
        return set(self.inflight.tasks()) if self.inflight is not None else set()

    # --- watching ---------------------------------------------------------------------------
    def check(self, alive: dict[str, str]) -> list[TaskRef] | None:
        """Watch the step in flight (``alive``: the workers still there -> their incarnation).
        Returns the train tasks to run again when it was aborted (those whose gradient was in
        a member's sum or in a blob of a worker that left; possibly none: then ask again),
        None otherwise. A member restarted under its name (another incarnation, or seen
        leaving) is gone."""
        cmd = self.inflight
        if cmd is None:
            return None
        failed = self.group.step_error(cmd.id)
        if failed is not None:
            err = DigenError(failed["message"])
            err.exit_code = int(failed["exit_code"])
            raise err
        left = self.departed | {
            w for w in alive if w in cmd.incarnations and alive[w] not in ("", cmd.incarnations[w])
        }
        gone = [m for m in cmd.members if m not in alive or m in left]
        decided = self.group.decision(cmd.id)
        if decided is None and gone:
            decided = self.group.decide(cmd.id, ABORT, cmd.epoch)
        if decided is None:
            return None
        what, _, epoch = decided.partition(":")
        if what == COMMIT and int(epoch) == cmd.epoch:
            if cmd.writer in gone:  # committed: any other member holds the same state
                survivors = [m for m in cmd.members if m in alive and m not in left]
                if survivors and survivors[0] != cmd.writer:
                    log.warning(
                        "the step's writer %s left after the commit; %s finishes it", cmd.writer, survivors[0]
                    )
                    cmd.writer = survivors[0]
                    self.group.set_step(cmd)
                    self.queue.wake(*survivors)
            return None
        lost = self.lost_with_abort(cmd, left | {w for w in self._holders(cmd) if w not in alive})
        why = self.group.abort_reasons(cmd.id)
        self.aborts.append(
            {"step": cmd.id, "epoch": cmd.epoch, "gone": gone, "lost": [t.id for t in lost], "why": why}
        )
        log.warning(
            "step %s (epoch %d) aborted%s; %s",
            cmd.id,
            cmd.epoch,
            f" ({', '.join(gone)} left)" if gone else "",
            f"train tasks {', '.join(t.id for t in lost)} run again"
            if lost
            else "every gradient is still held",
        )
        self._count_abort(cmd, gone or sorted(left))
        self.inflight = None
        self.members = []  # a new epoch: the old process group may be broken
        return lost

    def _holders(self, cmd: StepCommand) -> set[str]:
        trained = self.ledger.trained.get(cmd.iteration, {})
        return {
            t.blob.worker for tid in cmd.tasks() if (t := trained.get(tid)) is not None and t.blob is not None
        }

    def lost_with_abort(self, cmd: StepCommand, left: set[str]) -> list[TaskRef]:
        """The tasks of aborted step ``cmd`` whose gradient is gone: those in the members'
        running sums (every member drops its sum), and the blobs of workers in ``left``."""
        trained = self.ledger.trained.get(cmd.iteration, {})
        lost = []
        for tid in cmd.tasks():
            t = trained.get(tid)
            if t is None or t.blob is None or t.blob.worker in left:
                lost.append(TaskRef.parse(tid))
        return lost

    def _count_abort(self, cmd: StepCommand, gone: list[str]) -> None:
        """Fail the job once the same step was aborted ``schedule.max_attempts`` times in a
        row with no member gone: a member fails it by itself (a bug, a wrong gradient), and
        asking again would loop forever."""
        if gone:
            self.failed_aborts.pop(cmd.id, None)
            return
        n = self.failed_aborts[cmd.id] = self.failed_aborts.get(cmd.id, 0) + 1
        if n < self.cfg.schedule.max_attempts:
            return
        why = "; ".join(f"{w}: {r}" for w, r in sorted(self.group.abort_reasons(cmd.id).items()))
        raise DigenError(
            f"the optimizer step {cmd.id} failed {n} times in a row ({why or 'no reason recorded'}); "
            f"fix the cause and rerun with --resume to continue from the last checkpoint"
        )

    # --- done -------------------------------------------------------------------------------
    def collect(self, task_id: str, res: StepAck | None) -> StepResult | None:
        """The writer acknowledged the step: the new version is in place on every member."""
        cmd = self.inflight
        if cmd is None or cmd.id != task_id or res is None:
            return None
        self.inflight = None
        self.failed_aborts.pop(task_id, None)
        self.ledger.outstanding.pop(task_id, None)
        self.version = res.version
        # the mini-batch's gradients are in the state now: nothing of it can be lost any more
        book = self.ledger.books[cmd.iteration]
        done = self.ledger.trained.get(cmd.iteration, {})
        committed = self.ledger.committed.setdefault(cmd.iteration, {})
        for tid in cmd.tasks():
            ref = TaskRef.parse(tid)
            stats = book.stats.get((ref.group, ref.part or 0))
            committed[tid] = stats.rows if stats is not None else 0
            done.pop(tid, None)
        return StepResult(
            cmd.iteration,
            self.version,
            {"grad_norm": res.grad_norm},
            [e.to_json() for e in res.events],
            res.checkpoint,
            self.asked,
            cmd.mini_batch,
            cmd.last_of_iteration,
            cmd.rows,
            cmd.tasks(),
        )

    def makes_version(self, task_id: str) -> int | None:
        cmd = self.inflight
        return cmd.version + 1 if cmd is not None and cmd.id == task_id else None

    def ask_again(self, task_id: str) -> None:
        """Ask the writer of the step in flight to acknowledge it again (see
        :meth:`StepGroup.ask_again`): its task is re-posted (the junk result goes) and the
        command written again, asked once more (:attr:`StepCommand.asked_again`, a new mark),
        so the writer, which applied it already, acknowledges it from what it holds."""
        cmd = self.inflight
        if cmd is None or cmd.id != task_id:
            return
        cmd.asked_again = count_junk_ack(self.junk_acks, task_id, self.cfg.schedule.max_attempts)
        log.warning(
            "step %s: its acknowledgement does not read; the writer %s is asked again", task_id, cmd.writer
        )
        payload = self.ledger.outstanding[task_id][1]
        self.queue.repost(STEP_QUEUE, task_id, payload.to_json())
        self.group.set_step(cmd)
        self.queue.wake(*cmd.members)

    def checkpoint_placed(self, folder: str | None) -> None:
        if folder is not None:
            self.checkpoint = folder
        self.publish_current()

    # --- the step group (StepGroup) ---------------------------------------------------------
    def ask(self, iteration: int, mini_batch: int, members: Membership, hold: Hold | None) -> bool:
        if hold is not None:
            kept = self.keep_version(iteration)
            self.keep_from = hold(self.version if kept is None else kept)
        names = members.members()
        return self.request(iteration, names, mini_batch, members.incarnations(names))

    def settle_departure(self, worker: str) -> set[str] | None:
        self.worker_left(worker)
        return self.in_flight_tasks()

    def settle(self, iteration: int) -> list[str]:
        return self.ledger.settle(iteration)

    def look(self, members: Membership) -> None:
        return None  # members come and go: a departure aborts the step in flight (watch)

    def watch(self, alive: Callable[[], dict[str, str]]) -> tuple[int, int, list[TaskRef]] | None:
        if self.inflight is None:
            return None
        iteration, mini_batch = self.inflight.iteration, self.inflight.mini_batch
        lost = self.check(alive())
        return None if lost is None else (iteration, mini_batch, lost)

    def reconcile(self) -> None:
        self.publish_current()
        if self.inflight is not None:
            self.group.set_step(self.inflight)

    def dead_task(self, dead: DeadLetter) -> Exception | None:
        return None


def count_junk_ack(counts: dict[str, int], task_id: str, limit: int) -> int:
    """Count one more acknowledgement of step ``task_id`` that did not read into ``counts``;
    returns the count, or raises :class:`DigenError` naming the step once it reaches
    ``limit`` (``schedule.max_attempts``): whoever keeps writing junk there would make the
    job ask forever."""
    n = counts[task_id] = counts.get(task_id, 0) + 1
    if n >= limit:
        raise DigenError(
            f"the acknowledgement of the optimizer step {task_id} did not read {n} times (schedule.max_attempts "
            f"{limit}; each quarantined as junk, see dead_letters.jsonl): something else writes its result in "
            f"Redis; rerun with --resume to continue from the last checkpoint"
        )
    return n


def _group_part(task_id: str) -> tuple[int, int | None]:
    ref = TaskRef.parse(task_id)
    return ref.group, ref.part
