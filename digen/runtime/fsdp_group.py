"""The controller's side of an FSDP trainer group (``train.fsdp: true``).

With FSDP the trainer workers of a job form one torch.distributed process group that holds
the trained weights, their gradients and AdamW state sharded (:mod:`digen.parallel.fsdp`; the
ranks run :mod:`workers.fsdp_loop`). The controller then does not own the optimizer: it
queues train tasks as usual (rank 0, the *leader*, leases them and every rank trains its share),
and at the optimizer step it queues a *step command* instead of summing gradients. The leader
acknowledges it once the group has stepped and published version v+1; the controller then
finishes the iteration as :meth:`Controller.step` does (metrics, checkpoint, ``StepDone``).

Keys (``P = digen:<job_id>:``, cleared with the job's other keys)::

    P fsdp:plan      string  JSON {"members": [sorted trainer names], "version": v,
                             "optimizer": path or null, "adam_steps": {...}}: written once by
                             the controller at job start
    P fsdp:store     string  JSON {"host", "port", "backend"}: rank 0's TCPStore, for the others
    P fsdp:joined    hash    member -> 1 once its loop joined (a second join is a restart)
    P fsdp:error     string  the first rank failure (set once)
    P q:step         list    step commands ``step:<iteration>`` (the task queue's machinery)

The group is fixed at job start. A member that dies or restarts fails the job (the others
would wait in a collective until its timeout): rerun with ``--resume``; the checkpoint holds
the whole optimizer state, whatever the group's size. A trainer that joins later idles.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from digen.config import TrainConfig
from digen.core.events import Instruction, Role, StepDone
from digen.errors import DigenError
from digen.optim import read_checkpoint
from digen.runtime.jobstate import JobState
from digen.runtime.queue import TaskQueue

log = logging.getLogger(__name__)

STEP_QUEUE = "step"
STEP_PREFIX = "step:"


class FsdpGroupFailed(DigenError):
    """A rank of the FSDP trainer group failed or left; the group cannot continue."""

    exit_code = 1


def step_id(iteration: int) -> str:
    return f"{STEP_PREFIX}{iteration}"


def is_step_id(task_id: str) -> bool:
    return task_id.startswith(STEP_PREFIX)


class FsdpGroup:
    """The group's rendezvous and failure keys in Redis (JSON only)."""

    def __init__(self, redis_client, job_id: str):
        self.r = redis_client
        self.p = f"digen:{job_id}:fsdp:"

    def set_plan(self, plan: dict) -> None:
        self.r.set(self.p + "plan", json.dumps(plan))

    def plan(self) -> dict | None:
        raw = self.r.get(self.p + "plan")
        return None if raw is None else json.loads(raw)

    def set_address(self, host: str, port: int, backend: str) -> None:
        self.r.set(self.p + "store", json.dumps({"host": host, "port": port, "backend": backend}))

    def address(self) -> dict | None:
        raw = self.r.get(self.p + "store")
        return None if raw is None else json.loads(raw)

    def join(self, worker: str) -> bool:
        """Record that ``worker``'s loop joined; False when it had joined before (a restart)."""
        return bool(self.r.hsetnx(self.p + "joined", worker, 1))

    def fail(self, worker: str, message: str) -> None:
        """Record the group's first failure (later ones are consequences: collective timeouts)."""
        self.r.set(self.p + "error", f"{worker}: {message}", nx=True)

    def error(self) -> str | None:
        raw = self.r.get(self.p + "error")
        return None if raw is None else raw.decode()


@dataclass
class ShardedStore:
    """The controller's view of an optimizer that lives sharded on the trainer group: the
    newest published version and its whole weights (kept for checkpoints and re-publishing
    after a Redis outage). Quacks like :class:`~digen.optim.ParameterStore` where the
    controller uses one (``version``, ``weights()``, ``save()``)."""

    version: int
    current: dict[str, torch.Tensor]
    adam_steps: dict[str, float] = field(default_factory=dict)
    """The step counts of the last checkpointing step command (the leader sends them)."""

    @classmethod
    def fresh(cls, weights: dict[str, torch.Tensor], train: TrainConfig) -> ShardedStore:
        """Version 0 from the policy's trained tensors, as :meth:`ParameterStore.weights` gives them."""
        return cls(0, {k: weights[k].detach().float().cpu().clone().contiguous() for k in sorted(weights)})

    @classmethod
    def load(cls, folder: Path, train: TrainConfig) -> tuple[ShardedStore, dict]:
        """A checkpoint's weights and ``state.json`` (its ``optimizer.safetensors`` is the ranks' to read)."""
        state, weights, _ = read_checkpoint(folder, optimizer=False)
        return cls(int(state["version"]), weights, dict(state.get("adam_steps", {}))), state

    def weights(self) -> dict[str, torch.Tensor]:
        return self.current

    def save(self, folder: Path, extra: dict | None = None) -> None:
        """Complete a checkpoint folder in :meth:`ParameterStore.save`'s format: the leader
        already wrote ``optimizer.safetensors`` there; add ``weights.safetensors`` and
        ``state.json``."""
        if not (folder / "optimizer.safetensors").exists():
            raise FsdpGroupFailed(
                f"the FSDP leader did not leave optimizer.safetensors in {folder}: the run directory must be "
                f"on a filesystem that the controller and the first trainer worker share"
            )
        save_file({k: v.contiguous() for k, v in self.current.items()}, str(folder / "weights.safetensors"))
        state = {"version": self.version, "adam_steps": self.adam_steps, **(extra or {})}
        (folder / "state.json").write_text(json.dumps(state, indent=1))


@dataclass
class FsdpControl:
    """Controller hooks for ``train.fsdp`` (see the module docstring)."""

    group: FsdpGroup
    queue: TaskQueue
    job: JobState
    store: ShardedStore
    members: list[str] = field(default_factory=list)
    steps: dict[str, float] = field(default_factory=dict)
    """Step commands queued and not yet acknowledged: id -> when queued."""

    @staticmethod
    def create(queue: TaskQueue, job: JobState, store: ShardedStore) -> FsdpControl:
        return FsdpControl(FsdpGroup(queue.redis, job.job_id), queue, job, store)

    def start(self, ctl, resume_from: Path | None) -> None:
        """Fix the group: the trainer workers known now, sorted by name (rank 0 first). A
        resumed job's ranks load the checkpoint's optimizer state."""
        self.members = sorted(n for n, w in ctl.workers.items() if ctl.role_of(w) is Role.TRAINER)
        if not self.members:
            raise FsdpGroupFailed(
                "train.fsdp: no trainer worker joined the job; start one (digen worker --role trainer)"
            )
        plan: dict = {
            "members": self.members,
            "version": self.store.version,
            "optimizer": None,
            "adam_steps": {},
        }
        if resume_from is not None:
            state = json.loads((resume_from / "state.json").read_text())
            plan["optimizer"] = str((resume_from / "optimizer.safetensors").resolve())
            plan["adam_steps"] = state.get("adam_steps", {})
        self.group.set_plan(plan)
        log.info("FSDP trainer group: %s (rank 0 leads)", ", ".join(self.members))

    def check(self, ctl) -> None:
        """Fail the job when a rank reported a failure or a member left the cluster."""
        err = self.group.error()
        gone = [m for m in self.members if m not in ctl.workers]
        if err is None and not gone:
            return
        what = err if err is not None else f"trainer worker(s) {', '.join(gone)} left the cluster"
        raise FsdpGroupFailed(
            f"the FSDP trainer group ({', '.join(self.members)}) cannot continue: {what}. Its membership is "
            f"fixed at job start (no elastic FSDP): rerun with --resume to continue from the last checkpoint"
        )

    # --- the optimizer step -------------------------------------------------------------
    def request_step(self, ctl, iteration: int) -> list[Instruction]:
        """Queue iteration ``iteration``'s step command (rows: the group checks its own count
        against the controller's; checkpoint: where the leader writes optimizer.safetensors)."""
        book = ctl.books[iteration]
        _, rows = book.gradient()  # gradients stay on the ranks; this checks rows > 0
        cfg = ctl.cfg
        folder = None
        if (iteration + 1) % cfg.output.checkpoint_every == 0 or iteration == cfg.iterations - 1:
            final = ctl.run.checkpoint_dir(iteration)
            folder = str(final.with_name(final.name + ".tmp").resolve())  # save_checkpoint's staging folder
        tid = step_id(iteration)
        payload = {"iteration": iteration, "rows": rows, "checkpoint": folder}
        self.steps[tid] = time.time()
        ctl.outstanding[tid] = (STEP_QUEUE, payload)
        self.queue.put(STEP_QUEUE, tid, payload)
        return []

    def collect_step(self, ctl, sched, task_id: str) -> list[Instruction]:
        """The leader acknowledged a step command: version v+1 is published. Finish the
        iteration as :meth:`Controller.step` does."""
        res = self.queue.get_result(task_id)
        if task_id not in self.steps or not isinstance(res, dict):
            return []
        t0 = self.steps.pop(task_id)
        ctl.outstanding.pop(task_id, None)
        iteration, version = int(task_id[len(STEP_PREFIX) :]), int(res["version"])
        weights = self.job.weights(version)
        if weights is None:
            raise FsdpGroupFailed(
                f"the FSDP leader acknowledged step {iteration} but version {version} is not in Redis"
            )
        previous = self.store.current
        self.store.version, self.store.current = version, weights
        self.store.adam_steps = res.get("adam_steps") or {}
        lag = int(ctl.cfg.schedule.resolved().max_staleness or 0)
        ctl.previous_weights = previous if lag else None
        self.job.drop_weights_before(version - 1 - lag)
        ctl.events += res["events"]
        t2 = time.time()
        ctl.finish_iteration(
            ctl.books[iteration], {"grad_norm": float(res["grad_norm"])}, self.store, previous, t2
        )
        return sched.handle(StepDone(iteration, t0, t2))

    def dead_task(self, task_id: str, error: str) -> FsdpGroupFailed:
        """The error for a dead train task or step command: the group's gradient (or its
        step) is incomplete, so no ``schedule.on_poison: drop`` can save the iteration."""
        first = (error.strip().splitlines() or ["no error recorded"])[0]
        return FsdpGroupFailed(
            f"task {task_id} of the FSDP trainer group failed ({first}); fix the cause and rerun with --resume "
            f"to continue from the last checkpoint"
        )
