"""A trainer worker's loop when ``train.fsdp`` is on: one rank of the job's FSDP group.

:func:`workers.loop.worker_loop` hands over here once its first role tag says trainer. The
job's trainer workers (the member list the controller fixed at job start, sorted by name) form
one torch.distributed process group, rendezvous through Redis (no pickle anywhere):

1. rank 0 starts a ``TCPStore`` on its host (OS-assigned port) and writes host/port/backend
   to Redis (:class:`~digen.runtime.fsdp_group.FsdpGroup`); the others poll for it and
   connect; every rank calls ``init_process_group`` (gloo on CPU, NCCL on CUDA);
2. every rank loads the start version's weights from Redis, shards them with
   :class:`~digen.parallel.fsdp.ShardedTrainer` and, on ``--resume``, its share of the
   checkpoint's AdamW state (rank 0 reads the file and scatters);
3. rank 0, the leader, leases step commands and train tasks from Redis and broadcasts each
   as a JSON command; every rank runs it together:

   - ``train``: read the group's trajectories from Redis, build the task's rows, train this
     rank's share (:func:`~digen.parallel.fsdp.shard_rows`); the leader acknowledges with the
     stats summed over ranks and every rank's timeline event, no gradient (it stays sharded);
   - ``step``: AdamW step, gather the whole weights on rank 0, which publishes version v+1;
     on a checkpointing step also gather the AdamW state and rank 0 writes
     ``optimizer.safetensors`` where the command says; the leader acknowledges with the grad
     norm, the step counts and the ranks' events;
   - ``idle`` (nothing leased for a second: keeps collectives inside their timeout) and
     ``stop`` (the job left ``running``).

Any failure is recorded in Redis for the controller, which fails the job (the group is fixed:
rerun with --resume). A rank that waits on a dead peer fails at the collective timeout
(``schedule.lease_s``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from digen.core.events import Role, TaskKind, TaskRef
from digen.parallel.comm import all_gather_json, all_reduce_stats, broadcast_json, join_process_group
from digen.parallel.fsdp import ShardedTrainer, shard_rows
from digen.runtime.fsdp_group import STEP_QUEUE, FsdpGroup
from digen.testing import faults
from digen.training import TrainSpec, spec_rows
from workers.loop import WorkerRuntime

log = logging.getLogger(__name__)

POLL_S = 0.05
LEASE_BLOCK_S = 1.0
"""The leader waits this long for a task before broadcasting ``idle``."""


@dataclass
class Rank:
    """One rank of the trainer group and what it holds between commands."""

    rt: WorkerRuntime
    group: FsdpGroup
    rank: int
    world: int
    comm: torch.device
    """Where collective buffers live: CPU for gloo, the rank's GPU for NCCL."""
    trainer: ShardedTrainer | None = None
    names: list[str] = field(default_factory=list)
    """Trained tensor names, in ``trainer.params`` order."""
    tasks_run: int = 0

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def event(self, kind: str, iteration: int, version: int, start: float, end: float) -> dict:
        rt = self.rt
        return {
            "worker": rt.name,
            "gpu_type": rt.gpu_type,
            "role": Role.TRAINER.value,
            "kind": kind,
            "iteration": iteration,
            "version": version,
            "start": start,
            "end": end,
        }


def run_fsdp_rank(rt: WorkerRuntime, host: str | None = None) -> dict:
    """Be this worker's rank of the job's FSDP group until the job stops. ``host``: this
    worker's address as the other trainers reach it, where rank 0 serves the rendezvous
    (default: the host of its Dask worker address)."""
    group = FsdpGroup(rt.queue.redis, rt.job.job_id)
    plan = _wait_for(rt, group.plan, "the FSDP member list")
    if plan is None:
        return {"worker": rt.name, "tasks": 0}
    members = plan["members"]
    if rt.name not in members:
        log.warning(
            "trainer %s joined after job %s started: the FSDP group (%s) is fixed, so it gets no task; "
            "it takes part from the next job (or a --resume)",
            rt.name,
            rt.job.job_id,
            ", ".join(members),
        )
        _wait_for(rt, lambda: None, "the end of the job")
        return {"worker": rt.name, "tasks": 0}
    if not group.join(rt.name):
        message = "its worker loop restarted, and an FSDP group cannot take a rank back"
        group.fail(rt.name, message)
        raise RuntimeError(f"{rt.name}: {message}")
    rk = Rank(rt, group, members.index(rt.name), len(members), torch.device(rt.device))
    try:
        if _init_process_group(rk, host or dask_worker_host()):
            _build_trainer(rk, plan)
            _serve(rk)
    except redis.ConnectionError:
        raise  # Redis gone for longer than schedule.redis_outage_s: the controller fails the job
    except Exception as exc:
        group.fail(rt.name, f"{type(exc).__name__}: {exc}")
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return {"worker": rt.name, "tasks": rk.tasks_run}


def dask_worker_host() -> str:
    """The host of this process's Dask worker address (127.0.0.1 outside a Dask worker)."""
    try:
        from distributed import get_worker
        from distributed.comm import get_address_host

        return get_address_host(get_worker().address)
    except (ImportError, ValueError):
        return "127.0.0.1"


def _wait_for(rt: WorkerRuntime, read, what: str):
    """Poll Redis with ``read`` until it returns a value; None once the job stops running."""
    while rt.job.status() == "running":
        value = read()
        if value is not None:
            return value
        time.sleep(POLL_S)
    log.info("job %s stopped while %s waited for %s", rt.job.job_id, rt.name, what)
    return None


# --- set-up -------------------------------------------------------------------------
def _init_process_group(rk: Rank, host: str) -> bool:
    """Join the group (see the module docstring); False when the job stopped first."""
    addr = join_process_group(
        leader=rk.leader,
        host=host,
        rank=rk.rank,
        world=rk.world,
        device=rk.comm,
        timeout_s=rk.rt.cfg.schedule.lease_s,
        publish=rk.group.set_address,
        await_address=lambda: _wait_for(rk.rt, rk.group.address, "the FSDP rendezvous address"),
    )
    if addr is None:
        return False
    log.info("%s is rank %d of %d of the FSDP group (%s)", rk.rt.name, rk.rank, rk.world, addr["backend"])
    return True


def _build_trainer(rk: Rank, plan: dict) -> None:
    """Load the start version, shard it, restore the optimizer on ``--resume``."""
    rt = rk.rt
    rt.ensure_version(int(plan["version"]))
    rt.weights_cache.clear()  # the shards are the copy from now on
    rk.names = [name for name, _ in rt.policy.named_trainable_parameters()]  # before sharding
    rk.trainer = ShardedTrainer(
        rt.policy,
        rt.cfg.train,
        activation_checkpointing=rt.cfg.train.activation_checkpointing,
        version=int(plan["version"]),
    )
    if plan.get("optimizer"):
        tensors = load_file(plan["optimizer"]) if rk.leader else None
        rk.trainer.load_optimizer_state(rk.names, tensors, plan["adam_steps"])


# --- commands -------------------------------------------------------------------------
def _serve(rk: Rank) -> None:
    while True:
        cmd = broadcast_json(_next_command(rk) if rk.leader else None, device=rk.comm)
        if cmd["op"] == "stop":
            return
        if cmd["op"] == "train":
            _train(rk, cmd)
        elif cmd["op"] == "step":
            _step(rk, cmd)


def _next_command(rk: Rank) -> dict:
    """The leader's next command: a step command first, then a train task, else ``idle``."""
    rt = rk.rt
    if rt.job.status() != "running":
        return {"op": "stop"}
    leased = rt.queue.lease([STEP_QUEUE, TaskKind.TRAIN.value], rt.name, block_s=LEASE_BLOCK_S)
    if leased is None:
        return {"op": "idle"}
    op = "step" if leased.queue == STEP_QUEUE else "train"
    return {"op": op, "id": leased.task_id, "payload": leased.payload}


def _train(rk: Rank, cmd: dict) -> None:
    rt, trainer = rk.rt, rk.trainer
    assert trainer is not None
    payload = cmd["payload"]
    spec = TrainSpec.from_json(payload["spec"])
    if trainer.version != spec.iteration:  # iteration i trains version i
        raise RuntimeError(
            f"train task {cmd['id']} needs version {spec.iteration}, the group holds {trainer.version}"
        )
    t0 = time.time()
    gen_id = TaskRef(TaskKind.GEN, spec.iteration, spec.group).id
    data = rt.job.data(gen_id)
    if data is None:
        raise RuntimeError(f"trajectories of {gen_id} are missing from Redis")
    rows = shard_rows(spec_rows(spec, data, rt.cfg), rk.rank, rk.world)
    assert rt.embed is not None
    embeds = rt.embed(payload["prompt"]).repeat_rows(len(spec.samples))
    t1 = time.time()
    stats = trainer.accumulate(
        rows, embeds, rt.cfg, tsp=bool(payload["tsp"]), sigma_max=float(data["sigmas"][1])
    )
    mine = rk.event("train", spec.iteration, spec.iteration, t1, time.time())
    faults.point("train", rt.job, rt.name, task=cmd["id"], iteration=spec.iteration)
    total = all_reduce_stats(stats, device=rk.comm)
    events = all_gather_json(mine, device=rk.comm)
    _report(rk, cmd, t0, stats=total.to_json(), events=events)


def _step(rk: Rank, cmd: dict) -> None:
    rt, trainer = rk.rt, rk.trainer
    assert trainer is not None
    iteration, version = int(cmd["payload"]["iteration"]), trainer.version
    t0 = time.time()
    rows = _agreed_rows(rk, int(cmd["payload"]["rows"]))
    opt = trainer.step(total_rows=rows)
    t1 = time.time()
    weights = trainer.full_state_dict()
    if rk.leader:
        rt.job.publish(trainer.version, weights)
    del weights
    steps = _save_optimizer(rk, cmd["payload"]["checkpoint"])
    t2 = time.time()
    mine = [
        rk.event("optim", iteration, version, t0, t1),
        rk.event("sync", iteration, trainer.version, t1, t2),
    ]
    events = [e for part in all_gather_json(mine, device=rk.comm) for e in part]
    _report(rk, cmd, t0, grad_norm=opt["grad_norm"], version=trainer.version, adam_steps=steps, events=events)


def _report(rk: Rank, cmd: dict, t0: float, **fields) -> None:
    """Count a command this rank ran; the leader acknowledges it with ``fields`` and timings."""
    rk.tasks_run += 1
    if rk.leader:
        _ack(rk, cmd["id"], {**fields, "worker": rk.rt.name, "start": t0, "end": time.time()})


def _agreed_rows(rk: Rank, expected: int) -> int:
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


def _save_optimizer(rk: Rank, folder: str | None) -> dict[str, float]:
    """On a checkpointing step: gather AdamW's state; rank 0 writes ``optimizer.safetensors``
    into ``folder`` (ParameterStore.save's format; the controller adds the rest)."""
    if folder is None:
        return {}
    assert rk.trainer is not None
    tensors, steps = rk.trainer.optimizer_state(rk.names)
    if rk.leader:
        Path(folder).mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(Path(folder) / "optimizer.safetensors"))
    return steps


def _ack(rk: Rank, task_id: str, result: dict) -> None:
    if not rk.rt.queue.ack(task_id, result, worker=rk.rt.name):
        log.info("task %s was already acknowledged; this result is discarded", task_id)
