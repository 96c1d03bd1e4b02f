"""The controller's side of an FSDP trainer group (``train.fsdp: true``).

With FSDP the trainer workers of a job form one torch.distributed process group that holds
the trained weights, their gradients and AdamW state sharded (:mod:`digen.parallel.fsdp`; the
ranks run :mod:`digen.workers.fsdp_loop`). The controller queues train tasks as usual (rank 0, the
*leader*, leases them and every rank trains its share), and at the optimizer step it queues a
*step command*. The leader acknowledges it once the group has stepped: every rank then serves
its shard of version v+1 (rollout workers fetch the shards and put them together: no rank
gathers the whole model to publish it), and on a checkpointing step the leader has staged the
checkpoint. The controller then ends the iteration as for the replicated trainer group
(:meth:`digen.runtime.controller.Controller.end_iteration`).

Its keys in Redis (the plan, the rendezvous, who joined, the first failure) are
:class:`~digen.controlplane.fsdp_keys.FsdpGroup`'s, which the ranks read too; step commands go
through the task queue (:data:`~digen.controlplane.queue.STEP_QUEUE`).

The group is fixed at job start. A member that dies or restarts fails the job (the others
would wait in a collective until its timeout): rerun with ``--resume``; the checkpoint holds
the whole optimizer state, whatever the group's size. A trainer that joins later idles.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from digen.controlplane.fsdp_keys import FsdpGroup
from digen.controlplane.jobstate import JobState
from digen.controlplane.messages import StepAck
from digen.controlplane.payloads import FsdpStepPayload
from digen.controlplane.queue import STEP_QUEUE, DeadLetter, TaskQueue, step_id
from digen.core import versions
from digen.core.events import Role, TaskRef
from digen.errors import DigenError
from digen.iteration import checkpoints
from digen.rundir import RunDir
from digen.runtime.ledger import Ledger
from digen.runtime.steps import Hold, StepResult, count_junk_ack

if TYPE_CHECKING:
    from digen.runtime.membership import Membership

log = logging.getLogger(__name__)


class FsdpGroupFailed(DigenError):
    """A rank of the FSDP trainer group failed or left; the group cannot continue."""

    exit_code = 1


@dataclass
class FsdpControl:
    """The FSDP trainer group's :class:`~digen.runtime.steps.StepGroup` (``train.fsdp``; see
    the module docstring)."""

    group: FsdpGroup
    queue: TaskQueue
    job: JobState
    ledger: Ledger
    run: RunDir
    version: int
    checkpoint: str | None
    members: list[str] = field(default_factory=list)
    steps: dict[str, tuple[float, FsdpStepPayload]] = field(default_factory=dict)
    """Step commands queued and not yet acknowledged: id -> (when queued, payload)."""
    junk_acks: dict[str, int] = field(default_factory=dict)
    """step id -> its acknowledgements that did not read (:meth:`ask_again`)."""

    @staticmethod
    def create(
        queue: TaskQueue, job: JobState, ledger: Ledger, run: RunDir, version: int, checkpoint: str | None
    ) -> FsdpControl:
        return FsdpControl(FsdpGroup(queue.redis, job.job_id), queue, job, ledger, run, version, checkpoint)

    def start(self, membership) -> None:
        """Fix the group: the trainer workers known now, sorted by name (rank 0 first). A
        resumed job's ranks load the checkpoint's weights and optimizer state."""
        self.members = sorted(
            n for n, w in membership.workers.items() if membership.role_of(w) is Role.TRAINER
        )
        if not self.members:
            raise FsdpGroupFailed(
                "train.fsdp: no trainer worker joined the job; start one (digen worker --role trainer)"
            )
        self.group.set_plan({"members": self.members, "version": self.version, "checkpoint": self.checkpoint})
        log.info("FSDP trainer group: %s (rank 0 leads)", ", ".join(self.members))

    def check(self, membership) -> None:
        """Fail the job when a rank reported a failure or a member left the cluster."""
        err = self.group.error()
        gone = [m for m in self.members if m not in membership.workers]
        if err is None and not gone:
            return
        what = err if err is not None else f"trainer worker(s) {', '.join(gone)} left the cluster"
        raise FsdpGroupFailed(
            f"the FSDP trainer group ({', '.join(self.members)}) cannot continue: {what}. Its membership is "
            f"fixed at job start (no elastic FSDP): rerun with --resume to continue from the last checkpoint"
        )

    # --- the optimizer step -------------------------------------------------------------
    def request_step(self, iteration: int, mini_batch: int = 0, hold: Hold | None = None) -> None:
        """Queue the step command of ``iteration``'s mini-batch ``mini_batch`` (rows: the group
        checks its own count against the controller's; checkpoint: after an iteration's last
        mini-batch, the folder whose staging twin the leader writes; keep_from: the oldest
        version the ranks keep serving, the one a staleness-1 rollout may still use)."""
        cfg = self.ledger.cfg
        m_total = cfg.train.mini_batches
        last = mini_batch == m_total - 1
        rows = self.ledger.books[iteration].trained_rows(mini_batch)
        folder = None
        if last and checkpoints(cfg, iteration):
            folder = str(self.run.checkpoint_dir(iteration).resolve())
        keep_from = versions.kept_version(iteration, m_total, cfg.schedule.resolved().max_staleness)
        if hold is not None and not last:  # or older: what generation not yet done still needs
            # (an iteration's last step comes after all its groups were generated, and its
            # keep_from is also the checkpoint's previous version: left as the rule says)
            newest = versions.version(iteration, mini_batch, m_total) + 1
            keep_from = hold(newest if keep_from is None else keep_from)
            keep_from = None if keep_from == newest else keep_from
        tid = step_id(iteration, mini_batch, m_total)
        payload = FsdpStepPayload(iteration, mini_batch, last, rows, folder, keep_from)
        self.steps[tid] = (time.time(), payload)
        self.ledger.outstanding[tid] = (STEP_QUEUE, payload)
        self.queue.put(STEP_QUEUE, tid, payload.to_json())

    def collect(self, task_id: str, res: StepAck | None) -> StepResult | None:
        """The leader acknowledged a step command: the next version is served by the ranks."""
        if task_id not in self.steps or res is None:
            return None
        asked, payload = self.steps.pop(task_id)
        self.ledger.outstanding.pop(task_id, None)
        self.version = res.version
        return StepResult(
            payload.iteration,
            self.version,
            {"grad_norm": res.grad_norm},
            [e.to_json() for e in res.events],
            res.checkpoint,
            asked,
            payload.mini_batch,
            payload.last_of_iteration,
        )

    def makes_version(self, task_id: str) -> int | None:
        return self.version + 1 if task_id in self.steps else None  # one step at a time: the next

    def ask_again(self, task_id: str) -> None:
        """The leader's acknowledgement of step ``task_id`` did not read: the step command is
        re-posted (the junk result goes); the leader, which applied it already, leases it and
        acknowledges it again without a step (:mod:`digen.workers.fsdp_loop`)."""
        if task_id not in self.steps:
            return
        count_junk_ack(self.junk_acks, task_id, self.ledger.cfg.schedule.max_attempts)
        log.warning("step %s: its acknowledgement does not read; the FSDP leader is asked again", task_id)
        self.queue.repost(STEP_QUEUE, task_id, self.steps[task_id][1].to_json())

    # --- the step group (StepGroup) ---------------------------------------------------------
    def ask(self, iteration: int, mini_batch: int, members: Membership, hold: Hold | None) -> bool:
        self.request_step(iteration, mini_batch, hold)  # fixed members: nobody to wait for
        return True

    def settle_departure(self, worker: str) -> set[str] | None:
        return None  # a rank that leaves fails the job (look)

    def settle(self, iteration: int) -> list[str]:
        return []  # the group checks its own tasks' rows (each rank against the step's)

    def checkpoint_placed(self, folder: str | None) -> None:
        return None  # the leader staged it; nobody joins later

    def look(self, members: Membership) -> None:
        self.check(members)

    def watch(self, alive: Callable[[], dict[str, str]]) -> tuple[int, int, list[TaskRef]] | None:
        return None  # a step is never aborted: a failed rank fails the job

    def reconcile(self) -> None:
        return None  # the plan is written once at start; step commands are in the queue

    def dead_task(self, dead: DeadLetter) -> FsdpGroupFailed:
        """The error for a dead train task or step command: the group's gradient (or its
        step) is incomplete, so no ``schedule.on_poison: drop`` can save the iteration."""
        first = (dead.error.strip().splitlines() or ["no error recorded"])[0]
        return FsdpGroupFailed(
            f"task {dead.task_id} of the FSDP trainer group failed ({first}); fix the cause and rerun with --resume "
            f"to continue from the last checkpoint"
        )
