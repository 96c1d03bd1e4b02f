"""Who works on a job: the Dask workers the controller sees, their loops, and restarts.

:class:`Membership` keeps the job's view of the cluster: it places one worker loop on every
usable worker (:func:`digen.workers.loop.worker_loop`), turns workers that appear and disappear into
:class:`~digen.core.events.WorkerJoined` / :class:`~digen.core.events.WorkerLeft` events (a
worker restarted under the same name, a Nanny restart with a new address, left and joined
again), restarts a worker whose loop crashed in a fresh process, and fails the job when a
loop keeps crashing. It says who the trainer group's members are (:meth:`members`).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from digen.cluster.cluster import WorkerInfo, list_workers
from digen.config import Config
from digen.controlplane.jobstate import JobState
from digen.controlplane.redis_conn import SecretURL
from digen.controlplane.trainer_group import holds_optimizer
from digen.core.events import Event, Role, WorkerJoined, WorkerLeft
from digen.errors import ConfigError, DigenError

if TYPE_CHECKING:
    from distributed import Client, Future

log = logging.getLogger(__name__)

RESTART_GRACE_S = 60.0
"""A worker asked to restart whose process has not come back by then gets a loop anyway."""


@dataclass
class Membership:
    cfg: Config
    client: Client
    job: JobState
    redis_url: str
    loop_fn: Callable
    """The worker loop placed on every worker (:func:`digen.workers.loop.worker_loop`)."""
    exit_fn: Callable
    """Run on a worker to end its process (:func:`digen.cluster.cluster.exit_process`)."""
    workers: dict[str, WorkerInfo] = field(default_factory=dict)
    loops: dict[str, Future] = field(default_factory=dict)
    """Worker name -> the Dask future of its loop."""
    tokens: dict[str, str] = field(default_factory=dict)
    """Worker name -> the incarnation (token) of the loop placed on its current process."""
    loop_failures: dict[str, int] = field(default_factory=dict)
    restarting: dict[str, float] = field(default_factory=dict)
    """Workers asked to restart their process after a loop failure, since when."""
    ignored: set[str] = field(default_factory=set)
    """Workers whose GPU type is outside ``cluster.gpu_types`` (warned once)."""

    def role_of(self, w: WorkerInfo) -> Role:
        if w.role is Role.REWARD:  # scores in every mode
            return w.role
        return Role.COLOCATED if self.cfg.schedule.mode == "colocated" else w.role

    def members(self) -> list[str]:
        """The trainer group's members (sorted): the trainers whose loop placed on their current
        process runs (its token is the worker's loop) and has loaded its model (every
        non-reward worker in ``colocated`` mode); none with ``train.fsdp``. A worker restarted
        under its name is no member until its new loop is ready (its predecessor's ready mark
        does not count)."""
        mode, fsdp = self.cfg.schedule.mode, self.cfg.train.fsdp
        trainers = sorted(
            n
            for n, w in self.workers.items()
            if holds_optimizer(self.role_of(w), mode, fsdp) and n in self.loops and self.job.is_ready(n)
        )
        running = self.job.incarnations(trainers)  # (a key a restarted Redis lost: taken as is)
        return [n for n in trainers if running.get(n, self.tokens.get(n)) == self.tokens.get(n)]

    def incarnations(self, names: list[str]) -> dict[str, str]:
        """name -> incarnation of the loop placed on the current process of workers ``names``."""
        return {n: self.tokens[n] for n in names if n in self.tokens}

    def running(self, names: list[str]) -> dict[str, str]:
        """name -> the token of the loop that runs on the worker now (Redis): a loop that took
        over, or a restarted process, shows another one than its command names."""
        return self.job.incarnations(names)

    def sync(self, now: float) -> list[Event]:
        """Workers that joined or left since the last look, as scheduler events; restarts
        crashed loops. A worker restarted under the same name left and joined again."""
        seen = {w.name: w for w in list_workers(self.client) if self.usable(w)}
        out: list[Event] = []
        for name in list(self.workers):
            if name not in seen or seen[name].address != self.workers[name].address:
                del self.workers[name]
                self.loops.pop(name, None)
                out.append(WorkerLeft(name, now))
        for name, w in seen.items():
            if name not in self.workers:
                self.restarting.pop(name, None)
                self.workers[name] = w
                out.append(WorkerJoined(name, self.role_of(w), w.gpu_type, now))
                self.start_loop(w)
        for name, fut in list(self.loops.items()):
            if fut.status == "error":  # a crashed loop: a fresh worker process runs the next one
                self.loop_failed(name, fut.exception())
                self.restart_process(seen[name], now)
            elif fut.status == "finished" and self.job.status() == "running":
                log.warning("worker loop on %s stopped while the job runs; restarting it", name)
                self.start_loop(seen[name])
        for name, since in list(self.restarting.items()):  # a process that did not restart
            if name in self.workers and name not in self.loops and now - since > RESTART_GRACE_S:
                del self.restarting[name]
                self.start_loop(self.workers[name])
        return out

    def start_loop(self, w: WorkerInfo) -> None:
        """Place a worker loop on ``w``, with a new incarnation token (the loop claims it)."""
        token = self.tokens[w.name] = uuid.uuid4().hex
        self.loops[w.name] = self.client.submit(
            self.loop_fn,
            self.job.job_id,
            SecretURL(self.redis_url),
            self.cfg.model_dump(mode="json"),
            workers=[w.address],
            allow_other_workers=False,
            pure=False,
            key=f"digen-loop-{self.job.job_id}-{w.name}-{token[:8]}",
            threads=self.cfg.cluster.local.threads_per_worker,
            incarnation=token,
        )

    def restart_process(self, w: WorkerInfo, now: float) -> None:
        """Make the worker's process exit; its Nanny starts a new one, which rejoins under the
        same name (left + joined: a new loop). A failed model load, a CUDA error or a broken
        import leaves nothing behind in a fresh process."""
        self.loops.pop(w.name, None)
        self.restarting[w.name] = now
        try:
            self.client.run(self.exit_fn, workers=[w.address])
        except Exception as exc:  # noqa: BLE001 - it died already: the re-join restarts it
            log.info("could not stop worker %s (%s)", w.name, exc)

    def usable(self, w: WorkerInfo) -> bool:
        """False for a worker whose GPU type ``cluster.gpu_types`` leaves out (warned once)."""
        allowed = self.cfg.cluster.gpu_types
        if not allowed or w.gpu_type in allowed:
            return True
        if w.name not in self.ignored:
            self.ignored.add(w.name)
            log.warning(
                "worker %s (gpu-%s) gets no task: cluster.gpu_types is %s", w.name, w.gpu_type, allowed
            )
        return False

    def task_done(self, worker: str) -> None:
        """A task finished on ``worker``: its loop works (its crash count starts again)."""
        self.loop_failures.pop(worker, None)

    def loop_failed(self, name: str, exc: BaseException | None) -> None:
        """Count a crashed worker loop; ``schedule.max_attempts`` crashes in a row, with no task
        done in between, fail the job with the loop's error (a model that does not load...)."""
        n = self.loop_failures[name] = self.loop_failures.get(name, 0) + 1
        what = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        if n >= self.cfg.schedule.max_attempts:
            err = DigenError(
                f"the worker loop on {name} failed {n} times in a row ({what}); "
                f"fix the cause and rerun with --resume"
            )
            err.exit_code = getattr(exc, "exit_code", 1)
            raise err
        log.warning(
            "worker loop on %s failed (%s); restarting its process (%d/%d)",
            name,
            what,
            n,
            self.cfg.schedule.max_attempts,
        )

    def needed_roles(self) -> set[Role]:
        return {Role.COLOCATED} if self.cfg.schedule.mode == "colocated" else {Role.ROLLOUT, Role.TRAINER}

    def wait_ready(
        self, on_events: Callable[[list[Event]], None], expected: int = 0, timeout_s: float = 600.0
    ) -> None:
        """Before the first release: wait until ``expected`` workers have joined (the local
        cluster's size; Dask's worker list can lag its start-up), a worker of every role the
        mode needs is there (an external scheduler's workers may register after the job
        starts), and every worker's loop has loaded the model, so the first tasks do not all
        go to whichever worker loaded first (and iteration 0's wall time measures training,
        not loading). A loop that fails is restarted as during the run; after ``timeout_s``
        the job starts with the workers that are ready."""
        deadline = time.time() + timeout_s
        while True:
            waiting = sorted(n for n in self.workers if not self.job.is_ready(n))
            roles = {self.role_of(w) for w in self.workers.values()}
            if not waiting and len(self.workers) >= expected and self.needed_roles() <= roles:
                return
            if time.time() > deadline:
                log.warning(
                    "starting with %d worker(s), %s not ready after %.0f s",
                    len(self.workers),
                    ", ".join(waiting) or "none",
                    timeout_s,
                )
                return
            time.sleep(0.1)
            on_events(self.sync(time.time()))

    def check_gpu_types(self) -> None:
        """At start: the job's mode needs a worker of each role whose type may run tasks."""
        if not self.ignored:
            return
        roles = {self.role_of(w) for w in self.workers.values()}
        missing = sorted(r.value for r in self.needed_roles() - roles)
        if missing:
            allowed = self.cfg.cluster.gpu_types
            raise ConfigError(
                f"no {' or '.join(missing)} worker may run this job: cluster.gpu_types is {allowed} and the "
                f"workers {', '.join(sorted(self.ignored))} have other GPU types; add their type to "
                f"cluster.gpu_types or start workers with --gpu-type {allowed[0]}"
            )
