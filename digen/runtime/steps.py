"""The controller's side of the optimizer steps: ask the trainer group, watch, settle.

When every train task of an iteration is done, the scheduler says :class:`~digen.core.events.Step`.
:class:`StepControl` then writes a step command for the trainer group
(:class:`~digen.runtime.trainer_group.StepCommand`: the members and their epoch, the version
the step starts from, the rows to divide by, which member holds which task's gradient in its
running sum and which gradients are blobs, where to stage the checkpoint) and puts the step's
task id (``step:<iteration>``) in the ``step`` queue, where the writer acknowledges it.

While the step runs it watches (:meth:`StepControl.check`): a member that leaves before the
commit aborts the step (the decision key is written once, so the members apply it all or
none); an aborted step's gradients are gone with the members' sums, so its train tasks run
again (the scheduler asks for the step anew once they are done, in a new epoch); a writer that
leaves after the commit is replaced by another member, which holds the same state. The
acknowledgement (:meth:`StepControl.collect`) gives the new version, its grad norm and the
staged checkpoint.

The controller never holds a gradient or a weight: everything above is names and addresses.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from digen.config import Config
from digen.core.events import TaskRef
from digen.errors import DigenError
from digen.iteration import checkpoints
from digen.rundir import RunDir
from digen.runtime.ledger import Ledger
from digen.runtime.queue import STEP_QUEUE, TaskQueue, step_id
from digen.runtime.trainer_group import ABORT, COMMIT, StepCommand, TrainerGroup

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


@dataclass
class StepControl:
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
    inflight: StepCommand | None = None
    asked: float = 0.0
    keep_from: int | None = None
    """Members keep serving every version from this one on (an evaluation still to run)."""
    failed_aborts: dict[str, int] = field(default_factory=dict)
    """step id -> aborts in a row that no departure explains (a member failed by itself)."""

    @property
    def mini_batches(self) -> int:
        return self.cfg.train.mini_batches

    def keep_version(self, iteration: int) -> int | None:
        """Staleness 1: the version iteration ``iteration`` generated with, which the next
        iteration's rollouts may still use while its steps run (None at staleness 0)."""
        return self.mini_batches * iteration if self.cfg.schedule.resolved().max_staleness else None

    def publish_current(self) -> None:
        """Tell joining members which state to start from (and which older version to keep)."""
        iteration = -(-self.version // self.mini_batches) - 1  # the iteration whose steps made it
        keep = self.keep_version(max(iteration, 0)) if self.version else None
        self.group.set_current(self.version, self.checkpoint, keep)

    # --- asking -----------------------------------------------------------------------------
    def request(self, iteration: int, members: list[str], mini_batch: int = 0) -> bool:
        """Ask the trainer group for the step of ``iteration``'s mini-batch ``mini_batch``;
        False (ask again later) when no member is there to take it."""
        if not members:
            return False
        book = self.ledger.books[iteration]
        rows = book.trained_rows(mini_batch)
        trained = {
            k: t
            for k, t in self.ledger.trained.get(iteration, {}).items()
            if book.mini_batch(t.task.group) == mini_batch
        }
        exact = self.cfg.train.reduce == "exact"
        order = sorted(trained.values(), key=lambda t: (t.task.group, t.task.part or 0))
        blobs = [[t.task.id, t.blob.addr, t.blob.name, t.blob.digest] for t in order if t.blob is not None]
        held: dict[str, list[str]] = {}
        for t in order:
            if t.blob is None:
                held.setdefault(t.worker, []).append(t.task.id)
        if members != self.members:
            self.epoch, self.members = self.epoch + 1, list(members)
        last = mini_batch == self.mini_batches - 1
        folder = None
        if last and checkpoints(self.cfg, iteration):
            folder = str(self.run.checkpoint_dir(iteration).resolve())
        cmd = StepCommand(
            id=step_id(iteration, mini_batch, self.mini_batches),
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
        )
        self.group.forget_step(cmd.id)
        payload = {"iteration": iteration, "mini_batch": mini_batch}
        if not self.queue.put(STEP_QUEUE, cmd.id, payload):
            self.queue.repost(STEP_QUEUE, cmd.id, payload)
        self.ledger.outstanding[cmd.id] = (STEP_QUEUE, payload)
        self.group.set_step(cmd)
        self.queue.wake(*cmd.members)
        self.inflight, self.asked = cmd, time.time()
        return True

    # --- watching ---------------------------------------------------------------------------
    def check(self, alive: set[str]) -> list[TaskRef] | None:
        """Watch the step in flight (``alive``: the workers still there). Returns the train
        tasks to run again when it was aborted (those whose gradient was in a member's sum or
        in a blob of a worker that left; possibly none: then ask again), None otherwise."""
        cmd = self.inflight
        if cmd is None:
            return None
        failed = self.group.step_error(cmd.id)
        if failed is not None:
            err = DigenError(failed["message"])
            err.exit_code = int(failed["exit_code"])
            raise err
        gone = [m for m in cmd.members if m not in alive]
        decided = self.group.decision(cmd.id)
        if decided is None and gone:
            decided = self.group.decide(cmd.id, ABORT, cmd.epoch)
        if decided is None:
            return None
        what, _, epoch = decided.partition(":")
        if what == COMMIT and int(epoch) == cmd.epoch:
            if cmd.writer in gone:  # committed: any other member holds the same state
                survivors = [m for m in cmd.members if m in alive]
                if survivors and survivors[0] != cmd.writer:
                    log.warning(
                        "the step's writer %s left after the commit; %s finishes it", cmd.writer, survivors[0]
                    )
                    cmd.writer = survivors[0]
                    self.group.set_step(cmd)
                    self.queue.wake(*survivors)
            return None
        log.warning("step %s (epoch %d) aborted; its train tasks run again", cmd.id, cmd.epoch)
        self._count_abort(cmd, gone)
        self.inflight = None
        self.members = []  # a new epoch: the old process group may be broken
        book = self.ledger.books[cmd.iteration]
        trained = self.ledger.trained.get(cmd.iteration, {})
        return [
            t.task
            for t in trained.values()
            if book.mini_batch(t.task.group) == cmd.mini_batch
            and (t.blob is None or t.blob.worker not in alive)
        ]

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
    def collect(self, task_id: str, res) -> StepResult | None:
        """The writer acknowledged the step: the new version is in place on every member."""
        cmd = self.inflight
        if cmd is None or cmd.id != task_id or not isinstance(res, dict):
            return None
        self.inflight = None
        self.failed_aborts.pop(task_id, None)
        self.ledger.outstanding.pop(task_id, None)
        self.version = int(res["version"])
        # the mini-batch's gradients are in the state now: nothing of it can be lost any more
        book = self.ledger.books[cmd.iteration]
        done = self.ledger.trained.get(cmd.iteration, {})
        for k in [k for k, t in done.items() if book.mini_batch(t.task.group) == cmd.mini_batch]:
            del done[k]
        return StepResult(
            cmd.iteration,
            self.version,
            {"grad_norm": float(res["grad_norm"])},
            list(res.get("events", [])),
            res.get("checkpoint"),
            self.asked,
            cmd.mini_batch,
            cmd.last_of_iteration,
        )

    def checkpoint_placed(self, folder: str | None) -> None:
        if folder is not None:
            self.checkpoint = folder
        self.publish_current()
