"""One rank of a group of workers that run each task together: the skeleton the FSDP trainer
group (:mod:`digen.workers.fsdp_loop`) and a sequence-parallel replica
(:mod:`digen.workers.sp_loop`) share.

A group's members are ranks of one torch.distributed process group, formed through a
rendezvous key in the job's Redis (:func:`init_process_group`: rank 0 names the formation, the
others poll for it; no pickle anywhere). Rank 0, the *leader*, leases the group's tasks from
Redis and broadcasts each as a :class:`RankCommand`; every rank reads the command back checked
(:meth:`RankCommand.read`) and runs it (:func:`serve`): a task (the leased task whole: queue,
id, payload, attempt), ``idle`` (nothing leased for :data:`LEASE_BLOCK_S`: the ranks meet
again, so their collectives stay inside their timeout, ``schedule.lease_s``) or ``stop``.

The leader decides ``stop`` by one of two rules, and the difference is deliberate:

- :func:`job_stopped` (the FSDP group): the job left ``running``. An FSDP group is fixed at
  job start and a rank never gives its worker back; a newer worker loop on the same worker
  fails the job itself (:meth:`~digen.controlplane.fsdp_keys.FsdpGroup.join` refuses it a
  rank), and the controller ends the job. The ranks stop together with the job, never because
  one of them saw its worker taken: its peers would wait on it in a collective until the
  timeout.
- :func:`loop_stopped` (a sequence-parallel replica): what the worker loop itself stops on
  (:func:`~digen.workers.context.poll`): the job left ``running``, or a newer loop took the
  worker. A replica hands its worker back to the ordinary (d=1) loop when it ends, which
  would stop on the same poll; so it reads the worker's loop state as that loop does (and
  counts the cycle, waiting while the worker has no role tag), and a replica broken that way
  lets its followers go on at d=1.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from digen.controlplane.jsonkeys import Rendezvous
from digen.controlplane.queue import LeasedTask, is_task_id
from digen.errors import PayloadError
from digen.parallel.comm import broadcast_json
from digen.workers.context import WorkerContext, join_group, poll

log = logging.getLogger(__name__)

LEASE_BLOCK_S = 1.0
"""The leader waits this long for a task before broadcasting ``idle``."""
STOP, IDLE, TASK = "stop", "idle", "task"
OPS = (STOP, IDLE, TASK)
_TASK_KEYS = {"op", "queue", "id", "payload", "attempt"}


@dataclass(kw_only=True)
class Rank:
    """One rank of a group: its worker, its place, where its collective buffers live."""

    ctx: WorkerContext
    rank: int
    world: int
    comm: torch.device
    """Where collective buffers live: CPU for gloo, the rank's GPU for NCCL."""
    tasks_run: int = 0

    @property
    def leader(self) -> bool:
        return self.rank == 0


@dataclass(frozen=True)
class RankCommand:
    """What the leader broadcasts and every rank runs: ``stop``, ``idle``, or ``task`` with the
    task the leader leased (a follower runs the same one; its ``leased_at`` is not sent)."""

    op: str
    task: LeasedTask | None = None

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"a rank command's op is one of {', '.join(OPS)}, got {self.op!r}")
        if (self.op == TASK) != (self.task is not None):
            raise ValueError(
                f"a rank command {self.op!r} {'needs' if self.op == TASK else 'carries no'} task"
            )

    @staticmethod
    def of(leased: LeasedTask | None) -> RankCommand:
        """``task`` for a leased task, ``idle`` for none."""
        return RankCommand(IDLE) if leased is None else RankCommand(TASK, leased)

    def to_json(self) -> dict[str, Any]:
        if self.task is None:
            return {"op": self.op}
        t = self.task
        return {"op": self.op, "queue": t.queue, "id": t.task_id, "payload": t.payload, "attempt": t.attempt}

    @classmethod
    def read(cls, raw: object) -> RankCommand:
        """The command in ``raw`` (what :func:`~digen.parallel.comm.broadcast_json` gave);
        :class:`PayloadError` naming the fault when it is not one (not a map, an op unknown,
        a key unknown or missing, an id that is not a task id, a payload that is not a map,
        an attempt that is not a positive integer)."""
        if not isinstance(raw, dict):
            raise PayloadError(f"a rank command is a map, got {type(raw).__name__}")
        op = raw.get("op")
        if op not in OPS:
            raise PayloadError(f"a rank command's op is one of {', '.join(OPS)}, got {op!r:.60}")
        want = _TASK_KEYS if op == TASK else {"op"}
        if raw.keys() != want:
            odd = sorted(map(str, raw.keys() ^ want))
            raise PayloadError(f"a rank command {op!r} has the keys {sorted(want)}; these differ: {odd}")
        if op != TASK:
            return cls(op)
        queue, task_id, payload, attempt = raw["queue"], raw["id"], raw["payload"], raw["attempt"]
        if not isinstance(queue, str) or not queue:
            raise PayloadError(f"a rank command's queue is a name, got {queue!r:.60}")
        if not isinstance(task_id, str) or not is_task_id(task_id):
            raise PayloadError(f"a rank command's id is a task id, got {task_id!r:.60}")
        if not isinstance(payload, dict) or not all(isinstance(k, str) for k in payload):
            raise PayloadError(f"a rank command's payload is a text-keyed map, got {type(payload).__name__}")
        if not isinstance(attempt, int) or isinstance(attempt, bool) or attempt < 1:
            raise PayloadError(f"a rank command's attempt is a positive integer, got {attempt!r:.60}")
        return cls(TASK, LeasedTask(queue, task_id, payload, attempt))


def init_process_group(rk: Rank, rendezvous: Rendezvous, host: str | None, what: str) -> bool:
    """Join the group ``what`` (for the log) through ``rendezvous``; False when the job
    stopped or the leader left first. ``host``: where the leader serves the rendezvous
    (default: the host of its Dask worker address)."""
    addr = join_group(rk.ctx, rendezvous, rk.rank, rk.world, rk.comm, host)
    if addr is None:
        return False
    log.info("%s is rank %d of %d of %s (%s)", rk.ctx.name, rk.rank, rk.world, what, addr["backend"])
    return True


def lease_command(rk: Rank, queues: list[str], stopped: Callable[[], bool]) -> RankCommand:
    """The leader's next command: ``stop`` once ``stopped()`` (:func:`job_stopped` or
    :func:`loop_stopped`), else a task leased from ``queues`` (in that order), else ``idle``."""
    if stopped():
        return RankCommand(STOP)
    return RankCommand.of(rk.ctx.queue.lease(queues, rk.ctx.name, block_s=LEASE_BLOCK_S))


def serve(rk: Rank, next_command: Callable[[], RankCommand], run: Callable[[LeasedTask], None]) -> None:
    """Until ``stop``: the leader makes the next command (``next_command``), every rank gets
    it checked and runs its task (``run``); ``idle`` runs nothing."""
    while True:
        cmd = RankCommand.read(
            broadcast_json(next_command().to_json() if rk.leader else None, device=rk.comm)
        )
        if cmd.op == STOP:
            return
        if cmd.task is not None:
            run(cmd.task)


def job_stopped(ctx: WorkerContext) -> Callable[[], bool]:
    """The FSDP group's stop rule: the job left ``running`` (see the module docstring)."""
    return lambda: ctx.job.status() != "running"


def loop_stopped(ctx: WorkerContext, token: str) -> Callable[[], bool]:
    """A replica's stop rule: the worker loop's own (see the module docstring), which counts
    the cycle."""

    def stopped() -> bool:
        if poll(ctx, token) is None:
            return True
        ctx.cycles += 1
        return False

    return stopped
