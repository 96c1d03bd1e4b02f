"""A trainer worker's loop when ``train.fsdp`` is on: one rank of the job's FSDP group.

:func:`digen.workers.loop.worker_loop` hands over here once its first role tag says trainer. The
job's trainer workers (the member list the controller fixed at job start, sorted by name) form
one torch.distributed process group, rendezvous through Redis (no pickle anywhere):

1. rank 0 names a formation and its backend in Redis
   (:class:`~digen.controlplane.fsdp_keys.FsdpGroup`); the others poll for it; every rank calls
   ``init_process_group`` (gloo on CPU, NCCL on CUDA) over a store in the job's Redis
   (:mod:`digen.parallel.store`: no rendezvous port);
2. every rank starts from version 0 (its own seeded build) or, on ``--resume``, the
   checkpoint's weights (read from the file), shards them with
   :class:`~digen.parallel.fsdp.ShardedTrainer` and takes its share of the checkpoint's AdamW
   state and EMA (rank 0 reads the file and scatters);
3. rank 0, the leader, leases step commands and train tasks from Redis and broadcasts each
   as a rank command (:class:`~digen.workers.ranks.RankCommand`, read back checked: the
   skeleton this group shares with a sequence-parallel replica, :mod:`digen.workers.ranks`);
   every rank runs it together:

   - ``train``: fetch the group's trajectories (a batched task's groups': ``train.groups_per_task``,
     their rows packed together, so one all-gather serves a pass over several groups) from the
     worker that generated them, build the task's rows, train this rank's share (:func:`~digen.parallel.fsdp.shard_rows`); the leader
     acknowledges with the stats summed over ranks and every rank's timeline event, no gradient
     (it stays sharded). Trajectories that cannot be fetched (their worker died) park the task;
   - ``step``: AdamW step and the EMA of this rank's shards (``train.ema``); every rank
     serves its shard of version v+1 as a blob (rollout workers fetch every rank's shard and
     put them together; an evaluated version with ``train.ema.eval`` carries the EMA's shard
     too); on a checkpointing step the whole weights, AdamW state and EMA are gathered on
     rank 0, which stages the checkpoint where the command says; the leader acknowledges with
     the grad norm, the version and the ranks' events;
   - ``idle`` (nothing leased for a second: keeps collectives inside their timeout) and
     ``stop`` (the job left ``running``: :func:`~digen.workers.ranks.job_stopped`, whose
     docstring says why a rank does not stop when a newer loop takes its worker).

Any failure is recorded in Redis for the controller, which fails the job (the group is fixed:
rerun with --resume). A rank that waits on a dead peer fails at the collective timeout
(``schedule.lease_s``; half of it on NCCL: :func:`digen.parallel.comm.collective_timeout_s`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import redis
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from digen.algos.state import EMA_PREFIX, is_ema, with_ema
from digen.assembly import trained_dtype
from digen.controlplane.fsdp_keys import FsdpGroup
from digen.controlplane.messages import Result, StepAck, TrainResult
from digen.controlplane.payloads import FsdpStepPayload, TrainPayload
from digen.controlplane.queue import STEP_QUEUE, LeasedTask
from digen.core import blobnames
from digen.core.events import Role, TaskKind
from digen.core.timeline import TimelineRow
from digen.dataplane.blobs import BlobLost, fetch
from digen.dataplane.wire import host_copy
from digen.evaluation import carries_ema
from digen.models.base import FlowPolicy
from digen.parallel.comm import all_gather_json, all_reduce_stats
from digen.parallel.fsdp import ShardedTrainer, local_shards, local_trainable_shards, shard_of, shard_rows
from digen.testing import faults
from digen.training import batch_rows
from digen.workers.context import WorkerContext, wait_for
from digen.workers.ranks import IDLE, Rank, RankCommand, init_process_group, job_stopped, lease_command, serve
from digen.workers.tasks import TRAINING_TENSORS, batch_specs, batch_tensors, park

log = logging.getLogger(__name__)

POLL_S = 0.05


@dataclass(kw_only=True)
class TrainerRank(Rank):
    """One rank of the trainer group (:class:`~digen.workers.ranks.Rank`) and what it holds
    between commands."""

    group: FsdpGroup
    trainer: ShardedTrainer | None = None
    names: list[str] = field(default_factory=list)
    """Trained tensor names, in ``trainer.params`` order."""
    applied: dict[str, StepAck] = field(default_factory=dict)
    """The newest step this rank applied: id -> its acknowledgement (the leader acknowledges it
    again, without a step, when the controller re-posts it: the one stored did not read)."""

    def event(
        self, kind: str, iteration: int, version: int, start: float, end: float, cpu_s: float | None = None
    ) -> TimelineRow:
        """A timeline row of this rank; ``cpu_s``: the thread that ran it (:func:`time.thread_time`),
        for ``digen bench``'s bound."""
        ctx = self.ctx
        return TimelineRow(
            ctx.name, ctx.gpu_type, Role.TRAINER.value, kind, iteration, version, start, end, cpu_s=cpu_s
        )


def run_fsdp_rank(ctx: WorkerContext, host: str | None = None) -> dict:
    """Be this worker's rank of the job's FSDP group until the job stops. ``host``: this
    worker's address as the other trainers reach it, where rank 0 serves the rendezvous
    (default: the host of its Dask worker address)."""
    group = FsdpGroup(ctx.queue.redis, ctx.job.job_id)
    plan = wait_for(ctx, group.plan, "the FSDP member list")
    if plan is None:
        return {"worker": ctx.name, "tasks": 0}
    members = plan["members"]
    if ctx.name not in members:
        log.warning(
            "trainer %s joined after job %s started: the FSDP group (%s) is fixed, so it gets no task; "
            "it takes part from the next job (or a --resume)",
            ctx.name,
            ctx.job.job_id,
            ", ".join(members),
        )
        wait_for(ctx, lambda: None, "the end of the job")
        return {"worker": ctx.name, "tasks": 0}
    if not group.join(ctx.name):
        message = "its worker loop restarted, and an FSDP group cannot take a rank back"
        group.fail(ctx.name, message)
        raise RuntimeError(f"{ctx.name}: {message}")
    rk = TrainerRank(
        ctx=ctx, group=group, rank=members.index(ctx.name), world=len(members), comm=torch.device(ctx.device)
    )
    try:
        if init_process_group(rk, group.rendezvous(), host, "the FSDP group"):
            _build_trainer(rk, plan)
            _serve(rk)
    except redis.ConnectionError:
        raise  # Redis gone for longer than schedule.redis_outage_s: the controller fails the job
    except Exception as exc:
        group.fail(ctx.name, f"{type(exc).__name__}: {exc}")
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return {"worker": ctx.name, "tasks": rk.tasks_run}


# --- set-up -------------------------------------------------------------------------
def _build_trainer(rk: TrainerRank, plan: dict) -> None:
    """Start from version 0 (this rank's own build) or the checkpoint a resumed job names;
    shard; restore the optimizer on ``--resume``."""
    ctx = rk.ctx
    policy = ctx.ensure_policy()
    folder = plan.get("checkpoint")
    state: dict = {}
    if folder:
        policy.load_trainable_state_dict(load_file(str(Path(folder) / "weights.safetensors")))
        state = json.loads((Path(folder) / "state.json").read_text())
    ctx.version = int(plan["version"])
    rk.names = [name for name, _ in policy.named_trainable_parameters()]  # before sharding
    rk.trainer = ShardedTrainer(
        policy,
        ctx.cfg.train,
        activation_checkpointing=ctx.cfg.train.activation_checkpointing,
        version=int(plan["version"]),
    )
    tensors = load_file(str(Path(folder) / "optimizer.safetensors")) if folder and rk.leader else None
    if folder and state.get("adam_steps"):
        rk.trainer.load_optimizer_state(rk.names, tensors, state["adam_steps"])
    if folder and rk.trainer.ema is not None:  # the checkpoint's EMA, each rank its shard
        ema = None if tensors is None else {k[len(EMA_PREFIX) :]: v for k, v in tensors.items() if is_ema(k)}
        rk.trainer.load_ema(ema)
    kept = _serve_previous(rk, Path(folder), state) if folder else None
    _serve_shards(rk, kept)


def _serve_previous(rk: TrainerRank, folder: Path, state: dict) -> int | None:
    """A resumed job in digen mode generates its first iteration with the version before the
    checkpoint's, which no rank holds after a restart: serve this rank's shard of it again,
    from the checkpoint's ``previous_weights``; returns its version (None: none kept)."""
    prev, path = state.get("previous_version"), folder / "previous_weights.safetensors"
    if prev is None or not path.exists():
        return None
    ctx = rk.ctx
    shards = {k: shard_of(t, rk.rank, rk.world) for k, t in load_file(str(path)).items()}
    meta = {"version": str(prev), "rank": str(rk.rank), "world": str(rk.world)}
    ctx.blobs.put(blobnames.weights(ctx.job.job_id, int(prev)), shards, meta)
    return int(prev)


def _serve_shards(rk: TrainerRank, keep_from: int | None = None) -> None:
    """Offer this rank's shard of the current version (in the dtype the policy holds its trained tensors in) to the rollout
    workers, and drop the shards of versions older than ``keep_from`` (the version a
    staleness-1 rollout may still use; default: only the current one)."""
    ctx, trainer = rk.ctx, rk.trainer
    assert trainer is not None
    job, v = ctx.job.job_id, trainer.version
    ema = trainer.ema if carries_ema(ctx.cfg, v) else None  # an evaluated version: its EMA's shard too
    shards = shard_snapshot(ctx.ensure_policy(), trained_dtype(ctx.cfg), ema)
    ctx.blobs.put(
        blobnames.weights(job, v), shards, {"version": str(v), "rank": str(rk.rank), "world": str(rk.world)}
    )
    keep = {blobnames.weights(job, x) for x in range(v if keep_from is None else keep_from, v + 1)}
    stale = [
        str(b) for b in blobnames.of_job(ctx.blobs.names(), job, blobnames.WEIGHTS) if str(b) not in keep
    ]
    ctx.blobs.drop(*stale)
    versions = blobnames.versions(ctx.blobs.names(), job)
    ctx.trainer_group.set_holding(ctx.name, ctx.blob_addr, versions, None, shard=(rk.rank, rk.world))


def shard_snapshot(
    policy: FlowPolicy, dtype: torch.dtype, ema: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """This rank's shard of the current version, as it serves it: a host copy in ``dtype``
    (:func:`~digen.dataplane.wire.host_copy`), with this rank's shard of ``ema`` as
    ``ema/<name>`` when given (:func:`~digen.algos.state.with_ema`: a rollout worker puts
    every key's shards together alike). Never the shards themselves: the next step
    rewrites them in place while rollout workers may still fetch this version (staleness 1,
    ``keep_from``), which would hand them version v+1 as v, or bytes that fail its digest."""
    shards = local_trainable_shards(policy)
    if ema is not None:
        shards = with_ema(shards, local_shards(ema))
    return host_copy(shards, dtype)


# --- commands -------------------------------------------------------------------------
def _serve(rk: TrainerRank) -> None:
    serve(rk, lambda: _next_command(rk), lambda task: _run(rk, task))


def _next_command(rk: TrainerRank) -> RankCommand:
    """The leader's next command: a step command first, then a train task, else ``idle``; a
    step it applied already (re-posted: its acknowledgement did not read) is acknowledged
    again here, never run twice."""
    cmd = lease_command(rk, [STEP_QUEUE, TaskKind.TRAIN.value], job_stopped(rk.ctx))
    task = cmd.task
    if task is not None and task.queue == STEP_QUEUE and task.task_id in rk.applied:
        log.warning("step %s was applied already; its acknowledgement is sent again", task.task_id)
        _ack(rk, task.task_id, rk.applied[task.task_id].to_json())
        return RankCommand(IDLE)
    return cmd


def _run(rk: TrainerRank, task: LeasedTask) -> None:
    if task.queue == STEP_QUEUE:
        _step(rk, task)
    elif task.queue == TaskKind.TRAIN.value:
        _train(rk, task)
    else:
        raise RuntimeError(
            f"the FSDP group runs train tasks and step commands, not {task.queue} task {task.task_id}"
        )


def _train(rk: TrainerRank, leased: LeasedTask) -> None:
    ctx, trainer = rk.ctx, rk.trainer
    assert trainer is not None
    payload = TrainPayload.read(leased.payload)
    entries = batch_specs(leased.task_id, payload)
    specs = [e.spec for e in entries]
    spec, version = specs[0], payload.version  # mini-batch m of iteration i: digen.core.versions.version
    if trainer.version != version:
        raise RuntimeError(
            f"train task {leased.task_id} needs version {version}, the group holds {trainer.version}"
        )
    t0 = time.time()
    lost: BlobLost | None = None
    data: list = []
    try:
        data = batch_tensors(ctx, leased, entries, TRAINING_TENSORS)
    except BlobLost as exc:
        lost = exc
    missing = torch.tensor([0 if lost is None else 1], dtype=torch.int64, device=rk.comm)
    dist.all_reduce(missing)  # every rank trains the task, or none does
    if int(missing.item()):
        if rk.leader:
            park(ctx, leased, lost or BlobLost(f"the trajectories of {leased.task_id} are gone"))
        return
    assert ctx.embed is not None
    whole, embeds, sigma_max = batch_rows(specs, data, [ctx.embed(e.prompt) for e in entries], ctx.cfg)
    rows = shard_rows(whole, rk.rank, rk.world)
    t1, c1 = time.time(), time.thread_time()
    stats = trainer.accumulate(rows, embeds, ctx.cfg, tsp=payload.tsp, sigma_max=sigma_max)
    mine = rk.event("train", spec.iteration, version, t1, time.time(), time.thread_time() - c1)
    faults.point("train", ctx.job, ctx.name, task=leased.task_id, iteration=spec.iteration)
    total = all_reduce_stats(stats, device=rk.comm)
    events = [TimelineRow.read_exact(e) for e in all_gather_json(mine.to_json(), device=rk.comm)]
    _report(
        rk, leased, lambda end: TrainResult(worker=rk.ctx.name, start=t0, end=end, events=events, stats=total)
    )


def _step(rk: TrainerRank, leased: LeasedTask) -> None:
    ctx, trainer = rk.ctx, rk.trainer
    assert trainer is not None
    payload = FsdpStepPayload.read(leased.payload)
    iteration, version = payload.iteration, trainer.version
    t0 = time.time()
    rows = _agreed_rows(rk, payload.rows)
    opt = trainer.step(total_rows=rows, last_of_iteration=payload.last_of_iteration)
    ctx.version = trainer.version
    t1 = time.time()
    keep_from = payload.keep_from
    _serve_shards(rk, keep_from)
    folder = payload.checkpoint
    _stage_checkpoint(rk, folder, iteration, keep_from)
    t2 = time.time()
    mine = [
        rk.event("optim", iteration, version, t0, t1),
        rk.event("sync", iteration, trainer.version, t1, t2),
    ]
    gathered = all_gather_json([e.to_json() for e in mine], device=rk.comm)
    events = [TimelineRow.read_exact(e) for part in gathered for e in part]
    ack = StepAck(
        worker=ctx.name,
        start=t0,
        end=t2,
        events=events,
        grad_norm=float(opt["grad_norm"]),
        version=trainer.version,
        checkpoint=folder,
    )
    rk.applied = {leased.task_id: ack}
    _report(rk, leased, lambda end: replace(ack, end=end))


def _report(rk: TrainerRank, leased: LeasedTask, result: Callable[[float], Result]) -> None:
    """Count a command this rank ran; the leader acknowledges it with ``result`` (given when it ended)."""
    rk.tasks_run += 1
    if rk.leader:
        _ack(rk, leased.task_id, result(time.time()).to_json())


def _agreed_rows(rk: TrainerRank, expected: int) -> int:
    """The rows the group trained since the last step; they must be the controller's count
    (a task trained twice, or lost, would change the update)."""
    assert rk.trainer is not None
    n = torch.tensor([rk.trainer.local_rows], dtype=torch.int64, device=rk.comm)
    dist.all_reduce(n)
    rows = int(n.item())
    if rows != expected:
        raise RuntimeError(
            f"the FSDP group trained {rows} rows this iteration, the controller counted {expected}"
        )
    return rows


def _stage_checkpoint(rk: TrainerRank, folder: str | None, iteration: int, keep_from: int | None) -> None:
    """On a checkpointing step: gather the whole weights and AdamW state on rank 0, which
    stages the checkpoint in ``folder``'s twin ``iter_NNNN.tmp`` in the format of
    :meth:`digen.optim.ParameterStore.save` (the controller puts it in place). With
    ``keep_from`` (staleness 1) the checkpoint also keeps that older version, which the next
    iteration's rollouts use: rank 0 puts it together from the shards the ranks serve
    (``previous_weights``, in that dtype, as the replicated trainers keep it)."""
    if folder is None:
        return
    trainer = rk.trainer
    assert trainer is not None
    weights = trainer.full_state_dict()
    tensors, steps = trainer.optimizer_state(rk.names)
    ema = trainer.ema_state()
    if not rk.leader:
        return
    tensors.update({f"{EMA_PREFIX}{k}": v for k, v in ema.items()})  # as ParameterStore.save keeps it
    tmp = Path(folder).with_name(Path(folder).name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(tmp / "weights.safetensors"))
    save_file(tensors, str(tmp / "optimizer.safetensors"))
    state = {"version": trainer.version, "adam_steps": steps, "iteration": iteration}
    if keep_from is not None and keep_from != trainer.version:
        save_file(_gather_served(rk, keep_from), str(tmp / "previous_weights.safetensors"))
        state["previous_version"] = keep_from
    (tmp / "state.json").write_text(json.dumps(state, indent=1))


def _gather_served(rk: TrainerRank, version: int) -> dict[str, torch.Tensor]:
    """Version ``version`` whole, from the shards every rank serves (no collective: the
    ranks' blob servers answer while they wait in this step)."""
    ctx = rk.ctx
    name = blobnames.weights(ctx.job.job_id, version)
    holders = ctx.trainer_group.shard_holders(version)
    if not holders:
        raise RuntimeError(f"no rank serves every shard of version {version} to checkpoint it")
    parts = []
    for addr in holders:
        own = ctx.blobs.get(name) if addr == ctx.blob_addr else None
        parts.append(own.tensors if own is not None else fetch(addr, name)[0])
    return {k: torch.cat([p[k] for p in parts]).contiguous() for k in parts[0]}


def _ack(rk: TrainerRank, task_id: str, result: dict) -> None:
    if not rk.ctx.queue.ack(task_id, result, worker=rk.ctx.name):
        log.info("task %s was already acknowledged; this result is discarded", task_id)
