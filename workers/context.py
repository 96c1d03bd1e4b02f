"""What one worker process holds between tasks, and the helpers every worker loop shares.

:class:`WorkerContext` is the state of a worker's loop (:mod:`digen.workers.loop`): its policy and
reward, the weights version loaded, its connection to the job's Redis keys, and its end of the
data plane: the :class:`~digen.dataplane.blobs.BlobStore` of what it produced (trajectories,
gradients, weight versions) and the address peers fetch them from. The trainer's share of the
optimizer (:mod:`digen.workers.trainer`), the sequence-parallel ranks (:mod:`digen.workers.sp_loop`) and
the FSDP ranks (:mod:`digen.workers.fsdp_loop`) build on it; none of them imports the loop.
"""

from __future__ import annotations

import logging
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch

from digen.algos.registry import stateful_algorithm
from digen.algos.state import load_version
from digen.assembly import build_reward, trained_dtype
from digen.config import Config
from digen.controlplane.jobstate import JobState, LoopState
from digen.controlplane.jsonkeys import Rendezvous
from digen.controlplane.queue import TaskQueue
from digen.controlplane.redis_conn import RoundTrips
from digen.controlplane.trainer_group import StepCommand, TrainerGroup
from digen.core import blobnames
from digen.core.events import Role, TaskRef
from digen.core.timeline import TimelineRow
from digen.dataplane.blobs import BlobLost, BlobStore
from digen.dataplane.weights import fetch_version
from digen.errors import TaskDropped
from digen.parallel.comm import join_process_group
from digen.prompt_cache import EmbedCache
from digen.testing import faults
from digen.workers.preload import take_policy

if TYPE_CHECKING:
    from digen.models.base import FlowPolicy
    from digen.rewards.base import Reward

log = logging.getLogger(__name__)

T = TypeVar("T")

STOP_CHECK_S = 0.2
"""How often, at most, a running generation task reads the job's status (one GET)."""
WEIGHTS_WAIT_S = 300.0
"""How long a worker waits for some trainer to serve the weights version a task needs. A
version no trainer will serve (dropped, or beyond the next: a forged task's) fails at once
(:meth:`~digen.controlplane.trainer_group.TrainerGroup.why_unserved`)."""
POLL_S = 0.05


class GroupShare(Protocol):
    """What the loop and the tasks ask of a worker's share of the trainer group
    (:class:`digen.workers.trainer.Member`, which builds on this context: hence a protocol here)."""

    def add(self, task_id: str, grads: dict[str, torch.Tensor]) -> None: ...

    def run_step(self, cmd: StepCommand) -> None: ...

    def leave_group(self) -> None: ...


@dataclass
class WorkerContext:
    """What one worker holds between tasks."""

    name: str
    gpu_type: str
    cfg: Config
    queue: TaskQueue
    job: JobState
    device: str
    policy: FlowPolicy | None = None
    reward: Reward | None = None
    embed: EmbedCache | None = None
    version: int | None = None
    """The weights version loaded into ``policy`` (None: unknown, fetch before use)."""
    weights_cache: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    tasks_run: int = 0
    round_trips: RoundTrips | None = None
    """Requests this loop has sent to Redis (reported on each task's last timeline event)."""
    cycles: int = 0
    """Passes through the loop (one per leased task, plus idle ones)."""
    reported: tuple[int, int] = (0, 0)
    """(round_trips, cycles) at the last report."""
    stop_checked: float = 0.0
    blobs: BlobStore = field(default_factory=BlobStore)
    """What this worker serves to its peers (its process's store)."""
    blob_addr: str = ""
    """Where peers fetch this worker's blobs (``host:port``)."""
    member: GroupShare | None = None
    """This worker's share of the trainer group (trainers; every worker in ``colocated`` mode)."""
    incarnation: str = ""
    """The token of this loop (``P loop:<worker>``): a restarted worker keeps its name and
    takes a new one, and acts only on step commands that name it."""

    @property
    def trainer_group(self) -> TrainerGroup:
        """The job's trainer group as its Redis keys (who serves which version, each step's
        command and decision): not a torch process group, nor a prompt's group of samples."""
        return TrainerGroup(self.queue.redis, self.job.job_id)

    def ensure_reward(self) -> Reward:
        """The config's reward, built once per worker, on the worker's device."""
        if self.reward is None:
            self.reward = build_reward(self.cfg, device=self.device)
        return self.reward

    def job_stopped(self) -> bool:
        """True once the job left ``running`` (``digen cancel``): read at most every
        :data:`STOP_CHECK_S`, between denoising steps (:func:`~digen.rollout.generate_group`)."""
        now = time.monotonic()
        if now - self.stop_checked < STOP_CHECK_S:
            return False
        self.stop_checked = now
        return self.job.status() != "running"

    def report_redis(self, events: list[TimelineRow]) -> None:
        """Mark the task's last event with the round trips and loop cycles since the last task,
        for ``digen bench`` (:func:`digen.bench.worker_stats`), and the prompt cache's hits and
        misses since then (:func:`digen.iteration.cache_metrics`)."""
        if not events:
            return
        if self.embed is not None:
            events[-1].set(**self.embed.report())
        if self.round_trips is None:
            return
        now = (self.round_trips.count, self.cycles)
        events[-1].set(redis_round_trips=now[0] - self.reported[0], cycles=now[1] - self.reported[1])
        self.reported = now

    def ensure_policy(self) -> FlowPolicy:
        """The worker's policy, taken or built once (a no-op after the first call)."""
        if self.policy is None:
            self.policy = policy = take_policy(self.cfg, self.device)  # preloaded, or built now
            self.embed = EmbedCache.for_config(policy, self.cfg)
            algo = stateful_algorithm(self.cfg.train)
            if algo.keeps_state:  # version 0 carries the algorithm's state too (DiffusionNFT's old copy)
                w = policy.trainable_state_dict()
                load_version(policy, {**w, **algo.initial_state(w, self.cfg.train)})
        return self.policy

    def ensure_version(self, version: int) -> None:
        """Load weights ``version`` into the policy (a no-op when already loaded): from this
        worker's own blobs (a trainer serves the versions it made), else fetched from the
        trainers that hold it (:func:`~digen.dataplane.weights.fetch_version`), bucketed and
        in the dtype the policy holds its trained tensors in (the trainers publish them in it:
        the bits they compute with)."""
        policy = self.ensure_policy()
        if self.version == version:
            return
        own = self.blobs.get(blobnames.weights(self.job.job_id, version))
        weights = own.tensors if own is not None else self.weights_cache.get(version)
        if weights is None:
            weights = self._fetch_weights(version)
            faults.point("sync", self.job, self.name, task=f"weights:{version}", iteration=version)
            if self.cfg.model.lora.enabled:  # an adapter is small: keep it, and the one before
                self.weights_cache = {v: w for v, w in self.weights_cache.items() if v >= version - 1}
                self.weights_cache[version] = weights
        load_version(policy, weights)  # the trained tensors, and an algorithm's state beside them
        self.version = version

    def _fetch_weights(self, version: int) -> dict[str, torch.Tensor]:
        name = blobnames.weights(self.job.job_id, version)
        deadline = time.monotonic() + WEIGHTS_WAIT_S
        last = "no trainer serves it yet"
        start = zlib.crc32(self.name.encode())  # spread the workers' first buckets over holders
        while True:
            holders = [a for a in self.trainer_group.holders_of(version) if a != self.blob_addr]
            shards = None if holders else self.trainer_group.shard_holders(version)
            try:
                if holders:
                    return fetch_version(
                        holders, name, dtype=trained_dtype(self.cfg), start=start, version=version
                    )
                if shards:  # an FSDP group: every rank's dim-0 shard, put together here
                    n = len(shards)  # each worker starts at another rank: no rank serves all first
                    order = [(start + i) % n for i in range(n)]
                    got = {
                        r: fetch_version([shards[r]], name, dtype=trained_dtype(self.cfg), version=version)
                        for r in order
                    }
                    return {k: torch.cat([got[r][k] for r in range(n)]) for k in got[0]}
            except BlobLost as exc:
                last = str(exc)
            else:  # nobody serves it now: wait only if someone will
                gone = self.trainer_group.why_unserved(version)
                if gone is not None:
                    raise RuntimeError(f"weights version {version} cannot be fetched: {gone}")
            if self.job.status() != "running":
                raise TaskDropped(f"the job stopped while {self.name} waited for weights version {version}")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"weights version {version} could not be fetched in {WEIGHTS_WAIT_S:g} s: {last}"
                )
            time.sleep(POLL_S)

    def drop_blobs_before(self, iteration: int) -> None:
        """Forget trajectories and gradients of iterations up to ``iteration`` (stepped: no
        step can need them again)."""
        job = self.job.job_id

        def keep(name: str) -> bool:
            blob = blobnames.parse(name)
            if blob is None or blob.job != job or blob.kind not in blobnames.PER_TASK:
                return True
            try:
                return TaskRef.parse(blob.key).iteration > iteration
            except ValueError:
                return False

        self.blobs.drop_where(keep)


def poll(ctx: WorkerContext, token: str) -> LoopState | None:
    """The top of a loop cycle: the job's state as this worker sees it (its role tag: (role,
    off-role budget); the trainer group's step command; the newest stepped iteration), or None
    when the loop must stop (the job left ``running``, or a newer loop took the worker). One
    round trip (:meth:`JobState.loop_state`); waits while the worker has no tag yet."""
    while True:
        state = ctx.job.loop_state(ctx.name, token)
        if state.status != "running":
            return None
        if not state.owns_loop:
            log.info("worker %s: a newer loop took over; this one stops", ctx.name)
            return None
        if state.tag is not None:
            return state
        time.sleep(0.05)


def event(
    ctx: WorkerContext,
    role: Role,
    kind: str,
    task: TaskRef,
    version: int,
    s: float,
    e: float,
    cpu_s: float | None = None,
) -> TimelineRow:
    """A timeline row of this worker; ``cpu_s``: the CPU seconds the thread that ran it spent
    (:func:`time.thread_time`), where the task records them (``digen bench``'s bound on an
    oversubscribed machine)."""
    return TimelineRow(ctx.name, ctx.gpu_type, role.value, kind, task.iteration, version, s, e, cpu_s=cpu_s)


def wait_for(ctx: WorkerContext, read: Callable[[], T | None], what: str) -> T | None:
    """Poll Redis with ``read`` until it returns a value; None once the job stops running."""
    while ctx.job.status() == "running":
        value = read()
        if value is not None:
            return value
        time.sleep(POLL_S)
    log.info("job %s stopped while %s waited for %s", ctx.job.job_id, ctx.name, what)
    return None


def join_group(
    ctx: WorkerContext,
    rendezvous: Rendezvous,
    rank: int,
    world: int,
    device: torch.device,
    host: str | None = None,
    backend: str | None = None,
) -> dict | None:
    """Form a group's torch.distributed process group through its ``rendezvous`` key, with the
    job's collective timeout (``schedule.lease_s``): rank 0 serves it on ``host`` (default: this
    Dask worker's host), on ``backend`` (default: gloo on CPU, NCCL on CUDA). The address, or
    None when the job stopped or the group's leader left first. The trainer group, the FSDP
    group and the sequence-parallel replicas form theirs so."""

    def await_address() -> dict | None:
        found = wait_for(ctx, rendezvous.poll, rendezvous.what)
        return None if found is None or "gone" in found else found

    return join_process_group(
        leader=rank == 0,
        host=host or dask_worker_host(),
        rank=rank,
        world=world,
        device=device,
        timeout_s=ctx.cfg.schedule.lease_s,
        publish=rendezvous.publish,
        await_address=await_address,
        store=rendezvous.store,
        backend=backend,
    )


def dask_worker_host() -> str:
    """The host of this process's Dask worker address (127.0.0.1 outside a Dask worker)."""
    try:
        from distributed import get_worker
        from distributed.comm import get_address_host

        return get_address_host(get_worker().address)
    except (ImportError, ValueError):
        return "127.0.0.1"


def node_tls(cfg: Config) -> tuple[str, str, str] | None:
    """This node's TLS files ``(CA, certificate, key)`` for its blob server and fetches: those
    its Dask worker was started with (``digen worker --security``: the node's own, not the
    controller's, which the job's config names), else, outside a Dask worker or in one
    without TLS files, the config's ``security:`` section (None: no TLS)."""
    try:
        from distributed import get_worker

        tls = get_worker().security.get_tls_config_for_role("worker")
        if tls["ca_file"] and tls["cert"] and tls["key"]:
            return tls["ca_file"], tls["cert"], tls["key"]
    except (ImportError, ValueError):
        pass
    s = cfg.security
    if not s.enabled:
        return None
    assert s.ca_file and s.cert_file and s.key_file, "the config's loading refuses a partial security section"
    return s.ca_file, s.cert_file, s.key_file


class HeartbeatNotice(logging.Filter):
    """In a worker process: Dask's "Failed to communicate with scheduler during heartbeat"
    ERROR (with its traceback) becomes a WARNING, so the worker's console handler, at ERROR
    without ``--verbose``, leaves it out. The scheduler runs in the controller, so a worker
    fails a heartbeat when the controller closes it (seen at the end of a successful run on a
    loaded machine: the traceback was the run's only console output) or when the controller
    itself died, which the controller's own error already reports. Dask's worker goes on
    either way (it only logs it)."""

    MESSAGE = "Failed to communicate with scheduler during heartbeat."

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.ERROR and record.msg == self.MESSAGE:
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.exc_info, record.exc_text = None, None
        return True


def quiet_worker_heartbeat() -> None:
    """Install :class:`HeartbeatNotice` on this worker process's ``distributed.worker`` log (once)."""
    lg = logging.getLogger("distributed.worker")
    if not any(isinstance(f, HeartbeatNotice) for f in lg.filters):
        lg.addFilter(HeartbeatNotice())
