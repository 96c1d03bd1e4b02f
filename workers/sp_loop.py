"""A rollout worker's part in a sequence-parallel replica (``rollout.sequence_parallel: d``).

:func:`digen.workers.loop.worker_loop` calls :func:`run_sp_rank` once its worker is ready; it
returns at once for a worker outside the controller's plan (:mod:`digen.controlplane.sp_keys`),
else this worker is one rank of its replica until the job stops or the replica breaks, and
then the ordinary (d=1) loop goes on. Rendezvous as the FSDP group does
(:mod:`digen.workers.fsdp_loop`): the leader (rank 0) names a formation in Redis, every rank meets
the others in a store in the job's Redis (:mod:`digen.parallel.store`); one torch.distributed
group (gloo on CPU, NCCL on CUDA).

The leader reads its role tag, leases ``gen`` tasks (then ``eval`` ones) and broadcasts each
as a rank command (the skeleton the FSDP group shares: :mod:`digen.workers.ranks`); every rank loads the task's weights version and runs the same denoising
loop under :func:`~digen.parallel.ulysses.sequence_parallel` (each rank computes 1/d of the
tokens; every rank ends with the whole sample). The ranks then meet once more (an
all-gather of their names), so a rank that died during the task fails it on the others. In
a ``gen`` task the leader alone scores (a follower skips the reward); in an ``eval`` chunk
every rank scores its (identical) images, the leader alone stores them. The leader
acknowledges once per task, its timeline events carrying ``sp_degree`` and ``ranks`` (the replica, leader
first). Commands ``idle`` (nothing leased for a second: collectives stay within their
timeout, ``schedule.lease_s``) and ``stop`` (the job left ``running``, or a newer loop took
the worker: :func:`~digen.workers.ranks.loop_stopped`).

Cancellation: a replica's task is not dropped between denoising steps (the ranks would
disagree on the step at which they stop); the job stops after the task in hand.

Failure: any error on a rank (a peer that died makes the next collective fail; a task that
raises) ends the replica for this rank: the leader gives its task back (a failed attempt,
re-queued at once, :meth:`~digen.controlplane.queue.TaskQueue.nack`), the rank records that it
left (``sp:solo``) and runs on as a d=1 worker. A restarted rank does not re-join.
"""

from __future__ import annotations

import logging
import traceback
from dataclasses import dataclass

import redis
import torch
import torch.distributed as dist

from digen.controlplane.payloads import GenPayload
from digen.controlplane.queue import LeasedTask
from digen.controlplane.sp_keys import SpGroup
from digen.core.events import Role, TaskKind, TaskRef
from digen.parallel.comm import all_gather_json
from digen.parallel.ulysses import sequence_parallel
from digen.testing import faults
from digen.workers.context import WorkerContext, wait_for
from digen.workers.ranks import Rank, RankCommand, init_process_group, lease_command, loop_stopped, serve
from digen.workers.tasks import gen_result, generate, run_eval

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class ReplicaRank(Rank):
    """One rank of a replica (:class:`~digen.workers.ranks.Rank`; ``world``: the replica's size)."""

    group: SpGroup
    token: str
    """The worker loop's ownership token (the leader reads its role tag with it)."""
    replica: list[str]
    current: str | None = None
    """The leader's leased task in hand."""


def run_sp_rank(ctx: WorkerContext, token: str, host: str | None = None) -> int:
    """Be this worker's rank of its replica while the replica holds; the tasks it ran (0 for a
    worker outside the plan). ``host``: where the leader serves the rendezvous (default: the
    host of its Dask worker address)."""
    group = SpGroup(ctx.queue.redis, ctx.job.job_id)
    plan = wait_for(ctx, group.plan, "the sequence-parallel plan")
    replica = next((r for r in (plan or {}).get("replicas", []) if ctx.name in r), None)
    if replica is None:
        return 0
    if not group.join(ctx.name):
        group.leave(ctx.name, "its worker loop restarted, and a replica does not take a rank back")
        return 0
    rk = ReplicaRank(
        ctx=ctx,
        group=group,
        token=token,
        replica=list(replica),
        rank=replica.index(ctx.name),
        world=len(replica),
        comm=torch.device(ctx.device),
    )
    try:
        if init_process_group(rk, group.rendezvous(rk.replica[0]), host, f"replica {', '.join(rk.replica)}"):
            serve(rk, lambda: _next_command(rk), lambda task: _run(rk, task))
    except redis.ConnectionError:
        raise  # Redis gone for longer than schedule.redis_outage_s: the controller fails the job
    except Exception as exc:  # a peer died, a collective timed out or a task raised: go on at d=1
        _leave(rk, exc)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return rk.tasks_run


def _leave(rk: ReplicaRank, exc: Exception) -> None:
    ctx = rk.ctx
    why = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    log.warning("%s leaves its sequence-parallel replica (%s): %s", ctx.name, ", ".join(rk.replica), why)
    if rk.leader and rk.current is not None:
        ctx.queue.nack(
            rk.current,
            f"sequence-parallel replica {', '.join(rk.replica)} broke: {why}\n{traceback.format_exc(limit=5)}",
            max_attempts=ctx.cfg.schedule.max_attempts,
            worker=ctx.name,
        )
    rk.group.leave(ctx.name, why)


# --- commands -----------------------------------------------------------------------
def _next_command(rk: ReplicaRank) -> RankCommand:
    """The leader's next command: a generation task, else an evaluation chunk, else ``idle``;
    ``stop`` when the job stopped or a newer loop took this worker (the worker loop's own rule:
    :func:`~digen.workers.ranks.loop_stopped`). A replica takes no off-role work (its rollout
    budget for train tasks stays unused)."""
    cmd = lease_command(rk, [TaskKind.GEN.value, TaskKind.EVAL.value], loop_stopped(rk.ctx, rk.token))
    if cmd.task is not None:
        rk.current = cmd.task.task_id
    return cmd


def _run(rk: ReplicaRank, leased: LeasedTask) -> None:
    """Every rank runs the task under Ulysses; the leader stores and acknowledges it."""
    if leased.queue not in (TaskKind.GEN.value, TaskKind.EVAL.value):
        raise RuntimeError(f"a replica runs gen and eval tasks, not {leased.queue} task {leased.task_id}")
    ctx = rk.ctx
    with sequence_parallel(ctx.policy, None):
        if leased.queue == TaskKind.GEN.value:
            score = rk.leader and GenPayload.read(leased.payload).score
            traj, events, t0 = generate(ctx, leased, Role.ROLLOUT, score=score, stop=None)
        else:
            result, _ = run_eval(ctx, leased, Role.ROLLOUT)
    ranks = all_gather_json(ctx.name, device=rk.comm)  # every rank finished: a dead one fails the task here
    rk.tasks_run += 1
    if not rk.leader:
        return
    if leased.queue == TaskKind.GEN.value:
        result = gen_result(ctx, leased, traj, events, t0)
    for e in result.events:
        e.sp_degree, e.ranks = rk.world, list(ranks)
    ctx.report_redis(result.events)
    faults.point(
        "ack", ctx.job, ctx.name, task=leased.task_id, iteration=TaskRef.parse(leased.task_id).iteration
    )
    if not ctx.queue.ack(leased.task_id, result.to_json(), worker=ctx.name):
        log.info("task %s was already acknowledged (it ran twice); this result is discarded", leased.task_id)
    rk.current = None
