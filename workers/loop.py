"""The long-lived worker loop: pull tasks by role tag, run them, acknowledge.

The controller places one loop per Dask worker (``client.submit(run_worker_loop, ...,
workers=[addr])``: :func:`digen.cluster.cluster.run_worker_loop` imports this module on the
worker). The loop loads the policy once and starts this process's blob server (where its
peers fetch what it produces: :mod:`digen.dataplane.blobs`); a trainer (every worker in
``colocated`` mode) also takes its share of the optimizer (:mod:`digen.workers.trainer`). Then it
repeats: read this worker's role tag and the trainer group's step command from Redis (one
round trip) -> take part in the step if one is asked of it -> lease a task from the queues
:func:`digen.core.policy.pull_order` names -> run it (:mod:`digen.workers.tasks`) -> acknowledge.
It returns when the job's status leaves ``running``.
"""

from __future__ import annotations

import logging
import time
import traceback
import uuid
from collections.abc import Callable

import redis
import torch

from digen.config import Config
from digen.controlplane.jobstate import JobState
from digen.controlplane.queue import LeasedTask, TaskQueue
from digen.controlplane.redis_conn import connect, count_round_trips
from digen.controlplane.resources import gpu_type_of
from digen.controlplane.trainer_group import holds_optimizer
from digen.core.events import Role, TaskKind, TaskRef
from digen.core.policy import idle_kinds, pull_order
from digen.dataplane.auth import incarnation as process_incarnation
from digen.dataplane.auth import keyring
from digen.dataplane.blobs import local_server, local_store
from digen.errors import PayloadError, TaskDropped
from digen.rewards.http import share_breakers
from digen.startup import process_start_time
from digen.testing import faults
from digen.workers.context import WorkerContext, dask_worker_host, node_tls, poll, quiet_worker_heartbeat
from digen.workers.preload import LOAD_TIMES, worker_device
from digen.workers.tasks import RUNNERS, gen_batches, run_gen_batch
from digen.workers.trainer import Member

log = logging.getLogger(__name__)


IDLE_WAIT_S = 1.0
"""How long an idle worker waits for a task (woken at once by a new task, a new role tag or a
step command: the wait costs no round trip while nothing happens)."""


def next_task(ctx: WorkerContext, role: Role, budget: int) -> LeasedTask | None:
    """Lease by the tag's pull order. A worker takes an off-role task (a trainer: generation,
    TAG; a rollout worker: training, RAT) only when none of its own kind is ready and its
    budget allows (spent atomically in Redis, given back when the queue had nothing). When
    nothing is ready it waits (:meth:`TaskQueue.wait`) and returns None: the loop reads its
    tag again before the next lease."""
    order = pull_order(role, budget)
    idle = [k.value for k in idle_kinds(role)]  # evaluation: only when nothing else is queued
    if role is Role.COLOCATED or len(order) == 1:
        queues = [k.value for k in order] + idle
        leased = ctx.queue.lease(queues, ctx.name)
    else:
        own, other = order
        queues = [own.value, other.value, *idle]
        leased = ctx.queue.lease([own.value], ctx.name)
        if leased is None and ctx.job.take_budget(ctx.name):
            leased = ctx.queue.lease([other.value], ctx.name)
            if leased is None:
                ctx.job.return_budget(ctx.name)
        if leased is None:
            leased = ctx.queue.lease([own.value, *idle], ctx.name)
    if leased is None:
        ctx.queue.wait(queues, ctx.name, IDLE_WAIT_S)
    return leased


def worker_loop(
    job_id: str,
    redis_url: str,
    cfg_json: dict,
    name: str | None = None,
    gpu_type: str | None = None,
    device: str | None = None,
    threads: int = 1,
    trainer: bool | None = None,
    incarnation: str | None = None,
) -> dict:
    """Run tasks of ``job_id`` until the job stops. Returns counts for the controller's log.
    A reward worker (Dask resource ``reward``) loads no policy: it only scores. ``trainer``
    (default: the Dask resource ``trainer``) makes it a member of the trainer group.
    ``incarnation``: this loop's token, which the controller placing it chose (default: a new
    one); step commands name their members by it."""
    started = time.time()
    scorer = False
    try:  # inside a Dask worker: mark the task long-running so it does not block the pool
        from distributed import get_worker, secede

        w = get_worker()
        quiet_worker_heartbeat()
        secede()
        name = name or str(w.name)
        gpu_type = gpu_type or gpu_type_of(w.state.total_resources)
        scorer = Role.REWARD.value in w.state.total_resources
        if trainer is None:
            trainer = Role.TRAINER.value in w.state.total_resources
    except (ImportError, ValueError):
        pass
    assert name is not None
    torch.set_num_threads(threads)  # cluster.local.threads_per_worker, as the reference (compute_threads)
    cfg = Config.model_validate(cfg_json)
    r = connect(redis_url, outage_s=cfg.schedule.redis_outage_s)  # a Redis restart pauses the loop
    share_breakers(r)  # a reward server one worker found down fails every worker's calls at once
    round_trips = count_round_trips(r)
    server = local_server(dask_worker_host(), node_tls(cfg), cfg.security.auth_s)
    ctx = WorkerContext(
        name=name,
        gpu_type=gpu_type or "cpu",
        cfg=cfg,
        queue=TaskQueue(r, job_id, lease_s=cfg.schedule.lease_s),
        job=JobState(r, job_id),
        device=worker_device(cfg, device),
        round_trips=round_trips,
        blobs=local_store(),
        blob_addr=server.address,
    )
    keyring().add(job_id, ctx.job.blob_key())  # this job's blob requests are signed with it
    ctx.blobs.producer = f"{name}@{process_incarnation()}"  # who made a blob, named when it does not match
    token = ctx.incarnation = incarnation or uuid.uuid4().hex
    ctx.job.claim_loop(name, token)  # one loop per worker: an older one stops
    faults.point("start", ctx.job, name)
    if not scorer:
        ctx.ensure_policy()  # load before taking tasks: a joining worker never stalls a task
        ctx.version = 0  # every build is version 0 (digen.assembly.build_policy)
    role = Role.REWARD if scorer else Role.TRAINER if trainer else Role.ROLLOUT
    if holds_optimizer(role, cfg.schedule.mode, cfg.train.fsdp):
        ctx.member = Member.start(ctx)
    ctx.ensure_reward()
    ctx.job.note_startup(
        name, {"process": process_start_time(), "loop": started, **LOAD_TIMES, "ready": time.time()}
    )
    ctx.job.mark_ready(name, ctx.gpu_type)
    log.info("worker %s (%s) joined job %s", name, ctx.gpu_type, job_id)
    if cfg.rollout.sequence_parallel > 1 and not scorer:  # a rank of a replica first, if planned so
        from digen.workers.sp_loop import run_sp_rank

        ctx.tasks_run += run_sp_rank(ctx, token)
    stepped, step_mark = -1, None
    try:
        while (state := poll(ctx, token)) is not None:
            ctx.cycles += 1
            assert state.tag is not None
            role, budget = state.tag
            if cfg.train.fsdp and role is Role.TRAINER:  # a rank of the job's FSDP group from now on
                from digen.workers.fsdp_loop import run_fsdp_rank

                return run_fsdp_rank(ctx)
            if ctx.member is not None and state.step is not None and state.step != step_mark:
                step_mark = state.step
                try:
                    cmd = ctx.trainer_group.step()
                except PayloadError as exc:  # junk in tg:step: quarantined, never run or fatal
                    ctx.queue.quarantine(
                        "tg:step", ctx.trainer_group.r.get(ctx.trainer_group.step_key()), str(exc)
                    )
                    cmd = None
                if cmd is not None:
                    ctx.member.run_step(cmd)
            if state.stepped > stepped:
                stepped = state.stepped
                ctx.drop_blobs_before(stepped)
            leased = next_task(ctx, role, budget)
            if leased is not None and leased.queue == TaskKind.GEN.value and cfg.rollout.max_batch > 1:
                run_gen_tasks(ctx, [leased, *more_gen(ctx, leased, role)], role)
            elif leased is not None:
                run_task(ctx, leased, role)
    finally:
        if ctx.member is not None:
            ctx.member.leave_group()
    return {"worker": name, "tasks": ctx.tasks_run}


def more_gen(ctx: WorkerContext, first: LeasedTask, role: Role) -> list[LeasedTask]:
    """Up to ``rollout.max_batch - 1`` more generation tasks to run with ``first``, leased at
    once from its queue, without waiting (fewer when fewer are ready). A trainer (TAG: its
    off-role kind) spends a unit of its budget on each, as :func:`next_task` did on ``first``,
    and stops when the budget is spent."""
    more: list[LeasedTask] = []
    off_role = role is Role.TRAINER
    while len(more) + 1 < ctx.cfg.rollout.max_batch:
        if off_role and not ctx.job.take_budget(ctx.name):
            break
        leased = ctx.queue.lease([first.queue], ctx.name)
        if leased is None:
            if off_role:
                ctx.job.return_budget(ctx.name)
            break
        more.append(leased)
    return more


def extending(ctx: WorkerContext, batch: list[LeasedTask]) -> Callable[[], bool]:
    """The ``stop`` check of a batched generation (:func:`~digen.rollout.generate_groups`):
    the job's status (:meth:`WorkerContext.job_stopped`), and every quarter of
    ``schedule.lease_s`` the leases of the batch's tasks renewed, since a batch of k groups
    runs up to k times as long as one group (a lease already lost is re-delivered elsewhere:
    the first acknowledgement wins)."""
    every, last = ctx.cfg.schedule.lease_s / 4, time.monotonic()

    def stop() -> bool:
        nonlocal last
        if time.monotonic() - last > every:
            last = time.monotonic()
            for leased in batch:
                ctx.queue.extend(leased.task_id, worker=ctx.name)
        return ctx.job_stopped()

    return stop


def run_gen_tasks(ctx: WorkerContext, leased: list[LeasedTask], role: Role) -> None:
    """Run leased generation tasks, as batches of those that agree
    (:func:`~digen.workers.tasks.gen_batches`), each task acknowledged on its own. A batch
    that raises runs each of its tasks again alone (:func:`run_task`), so only a task that
    fails by itself is reported and counts an attempt."""
    try:
        batches = gen_batches(ctx, leased)
    except redis.ConnectionError:
        raise
    except Exception as exc:  # the prompts could not be encoded: every task is reported
        for task in leased:
            fail(ctx, task, exc)
        return
    for batch in batches:
        try:
            outcomes = run_gen_batch(ctx, batch, role, extending(ctx, batch))
        except redis.ConnectionError:
            raise
        except TaskDropped as exc:
            log.info("worker %s: %s", ctx.name, exc)
            return
        except Exception as exc:
            if len(batch) == 1:
                fail(ctx, batch[0], exc)
                continue
            # one task's fault (a reward that raises on its images) must not fail its batch-mates
            log.warning(
                "a batch of %d generation tasks failed on %s (%s); each runs alone", len(batch), ctx.name, exc
            )
            for task in batch:
                run_task(ctx, task, role)
            continue
        for task, outcome in zip(batch, outcomes, strict=True):
            acknowledge(ctx, task, outcome)


def fail(ctx: WorkerContext, leased: LeasedTask, exc: Exception) -> None:
    """Report a task that raised (:meth:`TaskQueue.nack`: re-delivered, or dead after
    ``schedule.max_attempts``)."""
    log.error("task %s failed on %s: %s", leased.task_id, ctx.name, exc)
    ctx.queue.nack(
        leased.task_id,
        f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=5)}",
        max_attempts=ctx.cfg.schedule.max_attempts,
        worker=ctx.name,
    )


def run_task(ctx: WorkerContext, leased: LeasedTask, role: Role) -> None:
    """Run a leased task and acknowledge it; a task that raises is reported (never kills the
    loop), one whose input is gone is parked by its runner."""
    try:
        outcome = RUNNERS[leased.queue](ctx, leased, role)
    except redis.ConnectionError:
        raise  # Redis gone for longer than schedule.redis_outage_s: not the task's fault
    except TaskDropped as exc:  # the job stopped: the loop ends at its next poll
        log.info("worker %s: %s", ctx.name, exc)
        return
    except Exception as exc:  # a failing task is reported, never kills the loop
        fail(ctx, leased, exc)
        return
    acknowledge(ctx, leased, outcome)


def acknowledge(ctx: WorkerContext, leased: LeasedTask, outcome) -> None:
    """Acknowledge a task that ran (its result counts once: the first acknowledgement wins)
    and do what its runner asked once it won; nothing for a parked task (None)."""
    if outcome is None:  # parked: its input is made again first
        return
    result, after = outcome
    result.incarnation = ctx.incarnation  # a result of a process that is gone does not count
    for e in result.events:  # when it left the queue: the bench's eval waits read it
        e.leased = leased.leased_at
    ctx.report_redis(result.events)
    faults.point(
        "ack", ctx.job, ctx.name, task=leased.task_id, iteration=TaskRef.parse(leased.task_id).iteration
    )
    if ctx.queue.ack(leased.task_id, result.to_json(), worker=ctx.name):
        if after is not None:
            after()
        faults.point(
            "acked", ctx.job, ctx.name, task=leased.task_id, iteration=TaskRef.parse(leased.task_id).iteration
        )
    else:
        log.info("task %s was already acknowledged (it ran twice); this result is discarded", leased.task_id)
    ctx.tasks_run += 1
