"""The controller: drives a job's :class:`Scheduler` with events from Redis and Dask.

It owns the optimizer (:class:`~digen.optim.ParameterStore`) and the iteration books, places a
worker loop on every Dask worker, turns the scheduler's instructions into Redis writes
(queued tasks, role tags, published weights) and the workers' acknowledgements back into
events. Everything it decides comes from the scheduler; everything it computes (advantages,
gradient sums, metrics) is the code the reference trainer runs.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import redis
import torch

from digen.config import Config
from digen.core.events import (
    Finish,
    Instruction,
    Release,
    RequeueWorker,
    Role,
    SetRole,
    Step,
    StepDone,
    TaskDone,
    TaskKind,
    TaskRef,
    WorkerJoined,
    WorkerLeft,
)
from digen.core.scheduler import Scheduler, SchedulerConfig
from digen.errors import ConfigError, ConnectionFailure, DigenError
from digen.iteration import IterationBook
from digen.rollout import Trajectories, plan_groups
from digen.rundir import RunDir
from digen.runtime.cluster import WorkerInfo, connect_scheduler, list_workers, start_local_cluster
from digen.runtime.fsdp_group import FsdpControl, is_step_id
from digen.runtime.jobstate import JobState
from digen.runtime.queue import DeadLetter, TaskQueue
from digen.runtime.redis_conn import SecretURL, connect, embedded_url, mask_url
from digen.trainer import (
    ProgressFn,
    build_policy,
    build_reward,
    compute_threads,
    open_store,
    save_checkpoint,
    timing_metrics,
)
from digen.training import TrainStats
from digen.viz import write_sample_grid

log = logging.getLogger(__name__)


class JobCancelled(DigenError):
    exit_code = 1


class PoisonTask(DigenError):
    """A task that failed ``schedule.max_attempts`` times, with ``schedule.on_poison: fail``."""


@dataclass
class Controller:
    cfg: Config
    run: RunDir
    queue: TaskQueue
    job: JobState
    client: object
    redis_url: str
    progress: ProgressFn | None = None
    books: dict[int, IterationBook] = field(default_factory=dict)
    loops: dict[str, object] = field(default_factory=dict)
    workers: dict[str, WorkerInfo] = field(default_factory=dict)
    events: list[dict] = field(default_factory=list)
    window_start: float = 0.0
    gen_versions: dict[int, dict[int, int]] = field(default_factory=dict)
    cluster: object = None
    """The local Dask cluster when digen started one (tests scale it)."""
    outstanding: dict[str, tuple[str, dict]] = field(default_factory=dict)
    """Released tasks not yet collected: id -> (queue, payload), to queue again if Redis lost them."""
    collected: set[str] = field(default_factory=set)
    """Tasks of unfinished iterations whose result (or death) is counted: never twice."""
    backlog: list[str] = field(default_factory=list)
    """Done tasks found by :meth:`reconcile`, collected with the next done ids."""
    dead: dict[int, list[str]] = field(default_factory=dict)
    """Dropped dead tasks per iteration (``schedule.on_poison: drop``)."""
    untrained: dict[int, set[tuple[int, int | None]]] = field(default_factory=dict)
    """(group, part) per iteration whose train task died: its samples do not count as trained."""
    tags: dict[str, tuple[Role, int]] = field(default_factory=dict)
    previous_weights: dict[str, torch.Tensor] | None = None
    """The version before the newest, while a staleness-1 rollout may still load it."""
    loop_failures: dict[str, int] = field(default_factory=dict)
    dead_seen: set[str] = field(default_factory=set)
    restarting: dict[str, float] = field(default_factory=dict)
    """Workers asked to restart their process after a loop failure, since when."""
    ignored: set[str] = field(default_factory=set)
    """Workers whose GPU type is outside ``cluster.gpu_types`` (warned once)."""
    deferred: list = field(default_factory=list)
    """Work :meth:`apply` runs after the instructions at hand (see :meth:`step`)."""
    fsdp: FsdpControl | None = None
    """With ``train.fsdp``: the trainer group owns the optimizer (digen.runtime.fsdp_group)."""

    # --- set-up -----------------------------------------------------------------------
    def role_of(self, w: WorkerInfo) -> Role:
        return Role.COLOCATED if self.cfg.schedule.mode == "colocated" else w.role

    def sync_workers(self, sched: Scheduler, now: float) -> list[Instruction]:
        """Workers that joined or left since the last look, as scheduler events. A worker
        restarted under the same name (a Nanny restart: new address) left and joined again:
        its leased tasks are re-queued and it gets a fresh loop."""
        seen = {w.name: w for w in list_workers(self.client) if self.usable(w)}
        out: list[Instruction] = []
        for name in list(self.workers):
            if name not in seen or seen[name].address != self.workers[name].address:
                del self.workers[name]
                self.loops.pop(name, None)
                out += sched.handle(WorkerLeft(name, now))
        for name, w in seen.items():
            if name not in self.workers:
                self.restarting.pop(name, None)
                self.workers[name] = w
                out += sched.handle(WorkerJoined(name, self.role_of(w), w.gpu_type, now))
                self.start_loop(w)
        for name, fut in list(self.loops.items()):
            if fut.status == "error":  # a crashed loop: a fresh worker process runs the next one
                self.loop_failed(name, fut.exception())
                self.restart_process(seen[name], now)
            elif fut.status == "finished" and self.job.status() == "running":
                log.warning("worker loop on %s stopped while the job runs; restarting it", name)
                self.start_loop(seen[name])
        for name, since in list(self.restarting.items()):  # a process that did not restart
            if name in self.workers and name not in self.loops and now - since > 60:
                del self.restarting[name]
                self.start_loop(self.workers[name])
        return out

    def restart_process(self, w: WorkerInfo, now: float) -> None:
        """Make the worker's process exit; its Nanny starts a new one, which rejoins under the
        same name (left + joined: a new loop). A failed model load, a CUDA error or a broken
        import leaves nothing behind in a fresh process."""
        from workers.loop import exit_process

        self.loops.pop(w.name, None)
        self.restarting[w.name] = now
        try:
            self.client.run(exit_process, workers=[w.address])
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

    def wait_ready(self, sched: Scheduler, expected: int = 0, timeout_s: float = 600.0) -> None:
        """Before the first release: wait until ``expected`` workers have joined (the local
        cluster's size; Dask's worker list can lag its start-up), a worker of every role the
        mode needs is there (an external scheduler's workers may register after the job
        starts), and every worker's loop has loaded the model, so the first tasks do not all
        go to whichever worker loaded first (and iteration 0's wall time measures training,
        not loading). A loop that fails is restarted as during the run; after ``timeout_s``
        the job starts with the workers that are ready."""
        deadline = time.time() + timeout_s
        colocated = self.cfg.schedule.mode == "colocated"
        needed = {Role.COLOCATED} if colocated else {Role.ROLLOUT, Role.TRAINER}
        while True:
            waiting = sorted(n for n in self.workers if not self.job.is_ready(n))
            roles = {self.role_of(w) for w in self.workers.values()}
            if not waiting and len(self.workers) >= expected and needed <= roles:
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
            self.sync_workers(sched, time.time())

    def check_gpu_types(self) -> None:
        """At start: the job's mode needs a worker of each role whose type may run tasks."""
        if not self.ignored:
            return
        roles = {self.role_of(w) for w in self.workers.values()}
        need = {Role.COLOCATED} if self.cfg.schedule.mode == "colocated" else {Role.ROLLOUT, Role.TRAINER}
        missing = sorted(r.value for r in need - roles)
        if missing:
            allowed = self.cfg.cluster.gpu_types
            raise ConfigError(
                f"no {' or '.join(missing)} worker may run this job: cluster.gpu_types is {allowed} and the "
                f"workers {', '.join(sorted(self.ignored))} have other GPU types; add their type to "
                f"cluster.gpu_types or start workers with --gpu-type {allowed[0]}"
            )

    def start_loop(self, w: WorkerInfo) -> None:
        from workers.loop import worker_loop

        self.loops[w.name] = self.client.submit(
            worker_loop,
            self.job.job_id,
            SecretURL(self.redis_url),
            self.cfg.model_dump(mode="json"),
            workers=[w.address],
            allow_other_workers=False,
            pure=False,
            key=f"digen-loop-{self.job.job_id}-{w.name}-{uuid.uuid4().hex[:6]}",
            threads=self.cfg.cluster.local.threads_per_worker,
        )

    # --- instructions -----------------------------------------------------------------
    def apply(self, sched: Scheduler, instructions: list[Instruction], prompts: list[str], store) -> bool:
        """Carry out instructions (steps feed new events back). True once finished."""
        pending = list(instructions)
        finished = False
        while pending:
            ins = pending.pop(0)
            if isinstance(ins, Release):
                pending += self.release(sched, ins, prompts, store)
            elif isinstance(ins, SetRole):
                self.tags[ins.worker] = (ins.role, ins.budget)
                self.job.set_tag(ins.worker, ins.role, ins.budget)
            elif isinstance(ins, RequeueWorker):
                lost = self.queue.requeue_worker(ins.worker)
                if lost:
                    log.warning("worker %s left; re-queued %s", ins.worker, lost)
            elif isinstance(ins, Step) and self.fsdp is not None:  # the trainer group steps
                pending += self.fsdp.request_step(self, ins.iteration)
            elif isinstance(ins, Step):
                pending += self.step(sched, ins.iteration, store)
            elif isinstance(ins, Finish):
                finished = True
        while self.deferred:  # an iteration's bookkeeping, once the next one's tasks are out
            self.deferred.pop(0)()
        return finished

    def book(self, iteration: int, prompts: list[str]) -> IterationBook:
        if iteration not in self.books:
            version = max(0, iteration - int(self.cfg.schedule.resolved().max_staleness or 0))
            self.books[iteration] = IterationBook(
                self.cfg, iteration, plan_groups(self.cfg, prompts, iteration, version)
            )
        return self.books[iteration]

    def release(self, sched: Scheduler, ins: Release, prompts: list[str], store) -> list[Instruction]:
        """Queue a task. A train task with no sample left (every reward NaN, or its generation
        task dead) is settled here with a zero gradient, as the reference trains it."""
        t = ins.task
        book = self.book(t.iteration, prompts)
        if t.kind is TaskKind.GEN:
            task = book.groups[t.group]
            assert task.version == ins.version, (task.version, ins.version)
            queue, payload = "gen", {"task": task.to_json()}
        else:
            spec = book.task_spec(t.group, t.part)
            if not spec.samples:  # with FSDP nothing is sent: the group's gradient stays as it is
                book.add_gradient(t.group, {} if self.fsdp else zero_gradient(store), TrainStats(), t.part)
                self.collected.add(t.id)
                return sched.handle(TaskDone(t, "", time.time(), time.time()))
            queue, payload = (
                "train",
                {
                    "spec": spec.to_json(),
                    "prompt": book.groups[t.group].prompt,
                    "tsp": bool(self.cfg.schedule.resolved().tsp),
                },
            )
        self.outstanding[t.id] = (queue, payload)
        self.queue.put(queue, t.id, payload)
        return []

    def step(self, sched: Scheduler, iteration: int, store) -> list[Instruction]:
        """Sum the iteration's gradients, step AdamW, publish the next version, log."""
        book = self.books[iteration]
        t0 = time.time()
        grad, rows = book.gradient()  # group order, as the reference sums
        previous = store.weights()
        with compute_threads(self.cfg):  # the grad-norm reduction: the reference's thread count
            opt_stats = store.step(grad, rows)
        t1 = time.time()
        self.job.publish(store.version, store.weights())
        lag = int(self.cfg.schedule.resolved().max_staleness or 0)
        self.previous_weights = previous if lag else None
        self.job.drop_weights_before(store.version - 1 - lag)
        t2 = time.time()
        ctl = {"worker": "controller", "gpu_type": "cpu", "role": "controller", "iteration": iteration}
        self.events += [
            {**ctl, "kind": "optim", "version": store.version - 1, "start": t0, "end": t1},
            {**ctl, "kind": "sync", "version": store.version, "start": t1, "end": t2},
        ]
        # metrics, checkpoint and sample grid wait until the tasks StepDone releases are queued:
        # the trainers start the next iteration while the controller writes files
        self.deferred.append(lambda: self.finish_iteration(book, opt_stats, store, previous, t2))
        return sched.handle(StepDone(iteration, t0, t2))

    def finish_iteration(self, book: IterationBook, opt_stats: dict, store, previous, now: float) -> None:
        k = book.iteration
        window = [e for e in self.events if e["end"] > self.window_start and e["worker"] != "controller"]
        busy = sum(
            min(e["end"], now) - max(e["start"], self.window_start) for e in window if e["kind"] != "sync"
        )
        wall = now - self.window_start
        metrics = book.metrics()
        metrics.update(opt_stats)
        if k in self.dead:
            metrics["dead_tasks"] = sorted(self.dead.pop(k))
            for g, part in self.untrained.pop(k, set()):  # scored but never trained
                n = len(book.task_spec(g, part).samples)
                metrics["samples"] -= n
                metrics["dropped_samples"] += n
        n_workers = max(len(self.workers), 1)
        metrics.update(timing_metrics([], n_workers, wall, metrics["samples"]))
        metrics["busy_s"] = busy
        metrics["bubble_ratio"] = max(0.0, 1 - busy / (n_workers * wall)) if wall > 0 else 0.0
        lags = [k - v for v in self.gen_versions.get(k, {}).values()]
        metrics.update(
            {"policy_version": store.version, "max_staleness": max(lags) if lags else 0, "workers": n_workers}
        )
        it_events = [e for e in self.events if e["iteration"] == k]
        self.run.append("timeline.jsonl", it_events)
        self.events = [e for e in self.events if e["iteration"] != k]
        self.run.append("metrics.jsonl", [metrics])
        cfg = self.cfg
        if cfg.output.sample_grid_every and (
            k % cfg.output.sample_grid_every == 0 or k == cfg.iterations - 1
        ):
            trajs = {}
            for g in book.groups:
                data = self.job.data(TaskRef(TaskKind.GEN, k, g.group).id)
                if data is not None:
                    trajs[g.group] = Trajectories.from_tensors(g, data)
            write_sample_grid(self.run.samples / f"iter_{k:04d}.png", trajs, book.groups)
        if (k + 1) % cfg.output.checkpoint_every == 0 or k == cfg.iterations - 1:
            lag = int(cfg.schedule.resolved().max_staleness or 0)
            save_checkpoint(self.run, store, k, previous if lag else None)
        groups = [g.group for g in book.groups]
        self.job.drop_data(  # a train task may have been split in halves
            [TaskRef(TaskKind.GEN, k, g).id for g in groups]
            + [TaskRef(TaskKind.TRAIN, k, g, p).id for g in groups for p in (None, 0, 1)]
        )
        del self.books[k]
        self.gen_versions.pop(k, None)
        self.collected = {t for t in self.collected if TaskRef.parse(t).iteration != k}
        self.window_start = now
        if self.progress is not None:
            self.progress(metrics)

    # --- results ----------------------------------------------------------------------
    def collect(self, sched: Scheduler, task_id: str) -> list[Instruction]:
        """Count an acknowledged task's result, once."""
        if task_id in self.collected:
            return []
        if self.fsdp is not None and is_step_id(task_id):
            return self.fsdp.collect_step(self, sched, task_id)
        ref = TaskRef.parse(task_id)
        res = self.queue.get_result(task_id)
        if not isinstance(res, dict) or ref.iteration not in self.books:
            return []
        self.collected.add(task_id)
        self.outstanding.pop(task_id, None)
        self.loop_failures.pop(res["worker"], None)
        book = self.books[ref.iteration]
        self.events += res["events"]
        if ref.kind is TaskKind.GEN:
            book.add_rewards(ref.group, torch.tensor(res["rewards"], dtype=torch.float32))
            self.gen_versions.setdefault(ref.iteration, {})[ref.group] = book.groups[ref.group].version
        else:
            grads = {} if self.fsdp is not None else self.job.data(task_id)  # FSDP: it stays sharded
            book.add_gradient(ref.group, grads, TrainStats.from_json(res["stats"]), ref.part)
        return sched.handle(TaskDone(ref, res["worker"], res["start"], res["end"]))

    def poisoned(self, sched: Scheduler, dead: DeadLetter, store) -> list[Instruction]:
        """A task that failed ``schedule.max_attempts`` times (its error is in
        ``dead_letters.jsonl``): fail the job, or (``on_poison: drop``) drop its samples: a dead
        generation task's samples count as dropped (NaN rewards) and its group trains nothing;
        a dead train task's group adds a zero gradient and its samples do not count."""
        if dead.task_id in self.dead_seen:
            return []
        self.dead_seen.add(dead.task_id)
        action = self.cfg.schedule.on_poison
        first = (dead.error.strip().splitlines() or ["no error recorded"])[0]
        self.run.append(
            "dead_letters.jsonl",
            [
                {
                    "task": dead.task_id,
                    "queue": dead.queue,
                    "attempts": dead.attempts,
                    "error": dead.error,
                    "action": action,
                    "time": time.time(),
                }
            ],
        )
        if self.fsdp is not None and (is_step_id(dead.task_id) or dead.queue == TaskKind.TRAIN.value):
            raise self.fsdp.dead_task(dead.task_id, dead.error)  # the group's gradient is incomplete
        if action == "fail":
            raise PoisonTask(
                f"task {dead.task_id} failed {dead.attempts} time(s): {first}; fix the cause and rerun "
                f"with --resume, or set schedule.on_poison=drop to drop such samples"
            )
        ref = TaskRef.parse(dead.task_id)
        if dead.task_id in self.collected or ref.iteration not in self.books:
            return []
        log.warning(
            "task %s is dead after %d attempt(s) (%s); its samples are dropped (schedule.on_poison: drop)",
            dead.task_id,
            dead.attempts,
            first,
        )
        self.collected.add(dead.task_id)
        self.outstanding.pop(dead.task_id, None)
        self.dead.setdefault(ref.iteration, []).append(dead.task_id)
        book = self.books[ref.iteration]
        if ref.kind is TaskKind.GEN:
            book.add_rewards(ref.group, torch.full((self.cfg.rollout.group_size,), float("nan")))
        else:
            self.untrained.setdefault(ref.iteration, set()).add((ref.group, ref.part))
            book.add_gradient(ref.group, zero_gradient(store), TrainStats(), ref.part)
        return sched.handle(TaskDone(ref, "", time.time(), time.time()))

    def reconcile(self, store) -> None:
        """After a Redis outage: write again what a restarted server may have lost (with
        ``appendfsync everysec``, up to its last second of writes). Every write is idempotent;
        tasks found done are collected with the next done ids."""
        log.warning("job %s: Redis was unreachable; checking the job's keys", self.job.job_id)
        if self.job.status() is None:
            self.job.set_status("running")
        versions = {store.version: store.weights}
        if self.previous_weights is not None:
            versions[store.version - 1] = lambda: self.previous_weights
        for v, weights in versions.items():
            if not self.job.has_weights(v):
                log.warning("weights version %d was lost with Redis; publishing it again", v)
                self.job.publish(v, weights())
        for worker, (role, budget) in self.tags.items():
            if self.job.tag(worker) is None:
                self.job.set_tag(worker, role, budget)
        for tid, (queue, payload) in list(self.outstanding.items()):
            state = self.queue.state(tid)
            if state is None:
                log.warning("task %s was lost with Redis; queuing it again", tid)
                self.queue.put(queue, tid, payload)
            elif state == "done":
                self.backlog.append(tid)


def zero_gradient(store) -> dict[str, torch.Tensor]:
    """A zero gradient for every trained tensor (a group that trains nothing)."""
    return {k: torch.zeros_like(v.detach()) for k, v in store.params.items()}


def preflight(cfg: Config, local: bool) -> None:
    """Fail in seconds, before any cluster starts, on a reward that does not exist or takes
    other arguments (:class:`ConfigError`) or whose server does not answer (:class:`RewardError`),
    and on a local cluster whose GPU type ``cluster.gpu_types`` leaves out."""
    allowed, gpu = cfg.cluster.gpu_types, cfg.cluster.local.gpu_type
    if local and allowed and gpu not in allowed:
        raise ConfigError(
            f"cluster.local.gpu_type ({gpu}) is not in cluster.gpu_types {allowed}: no local worker "
            f"may run a task; add {gpu} to cluster.gpu_types or set cluster.local.gpu_type"
        )
    reward = build_reward(cfg)
    try:
        for part, _ in getattr(reward, "parts", [(reward, 1.0)]):
            if callable(getattr(part, "health", None)):
                part.health()
    finally:
        reward.close()


def run_distributed(
    cfg: Config,
    out: Path,
    *,
    resume: bool = False,
    redis_url: str | None = None,
    scheduler: str | None = None,
    progress: ProgressFn | None = None,
    job_id: str | None = None,
    on_start=None,
) -> dict:
    """Run a job in ``colocated``, ``disaggregated`` or ``digen`` mode; returns the summary.

    Inputs are checked before anything is written or started (rewards, Redis, the Dask
    scheduler: errors within seconds, naming what and where). A Redis restart pauses the job
    for up to ``schedule.redis_outage_s``, then it continues (see docs/guarantees.md).
    """
    s = cfg.schedule.resolved()
    preflight(cfg, local=scheduler is None)
    r = connect(redis_url, outage_s=s.redis_outage_s)
    url = redis_url or embedded_url(r)
    client = connect_scheduler(scheduler, timeout_s=5.0) if scheduler is not None else None
    run = RunDir(out, cfg, resume=resume)
    job_id = job_id or uuid.uuid4().hex[:12]
    queue, job = TaskQueue(r, job_id, lease_s=s.lease_s), JobState(r, job_id)
    queue.clear()
    torch.manual_seed(cfg.seed)  # the LoRA init draws from it, exactly as in the reference
    policy = build_policy(cfg, device="cpu")
    state = open_store(cfg, run, policy, resume)
    del policy
    store = state.store
    fsdp = FsdpControl.create(queue, job, store.version, store.weights()) if cfg.train.fsdp else None
    if fsdp is not None:  # the trainer group owns the optimizer
        store = fsdp.store
    job.publish(store.version, store.weights())
    if state.previous_weights is not None:
        job.publish(store.version - 1, state.previous_weights)
    job.set_status("running")

    cluster = None
    if client is None:
        cl = cfg.cluster.local
        n_roll, n_train = cl.rollout_workers, cl.trainer_workers
        cluster, client = start_local_cluster(n_roll, n_train, cl.gpu_type, cl.threads_per_worker)
    ctl = Controller(
        cfg, run, queue, job, client, url, progress, cluster=cluster, previous_weights=state.previous_weights
    )
    ctl.fsdp = fsdp
    groups = cfg.rollout.prompts_per_iteration
    sched = Scheduler(
        SchedulerConfig(
            iterations=cfg.iterations,
            groups=groups,
            gap=bool(s.gap),
            tag=bool(s.tag),
            rat=bool(s.rat),
            max_staleness=int(s.max_staleness or 0),
            group_local_advantages=not cfg.train.global_std,
            start_iteration=state.start_iteration,
        )
    )
    prompts = cfg.prompt_list()
    retry = r.get_retry()
    redis_down = False
    try:
        ctl.sync_workers(sched, time.time())
        ctl.check_gpu_types()
        local = cfg.cluster.local
        ctl.wait_ready(sched, expected=local.rollout_workers + local.trainer_workers if cluster else 0)
        if fsdp is not None:
            fsdp.start(ctl, run.latest_checkpoint() if resume else None)
        if progress is not None:
            progress(
                {
                    "event": "start",
                    "dashboard": getattr(client, "dashboard_link", None),
                    "roles": {n: ctl.role_of(w).value for n, w in ctl.workers.items()},
                }
            )
        if on_start is not None:
            on_start(ctl)
        ctl.window_start = time.time()
        finished = ctl.apply(sched, sched.start(time.time()), prompts, store)
        last_check, outages = time.time(), getattr(retry, "outages", 0)
        while not finished:
            ids = ctl.backlog + queue.pop_done(timeout_s=0.05)
            ctl.backlog = []
            instructions: list[Instruction] = []
            for tid in ids:
                instructions += ctl.collect(sched, tid)
            now = time.time()
            if now - last_check > 0.5:
                last_check = now
                if getattr(retry, "outages", 0) != outages:
                    outages = retry.outages
                    ctl.reconcile(store)
                if fsdp is not None:
                    fsdp.check(ctl)
                instructions += ctl.sync_workers(sched, now)
                queue.requeue_expired(max_attempts=s.max_attempts)
                for dead in queue.dead_letters():
                    instructions += ctl.poisoned(sched, dead, store)
                if job.status() == "cancel":
                    raise JobCancelled(f"job {job_id} cancelled; the last checkpoint is kept in {out}")
            finished = ctl.apply(sched, instructions, prompts, store)
        job.set_status("done")
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        redis_down = True
        raise ConnectionFailure(
            f"Redis at {mask_url(url)} unreachable for more than {s.redis_outage_s:g} s ({type(exc).__name__}); "
            f"the last checkpoint is kept in {out}: rerun with --resume once Redis is back"
        ) from None
    except BaseException:
        job.set_status("failed" if job.status() != "cancel" else "cancelled")
        raise
    finally:
        for fut in ctl.loops.values():
            try:
                fut.result(timeout=1 if redis_down else 30)
            except Exception:  # noqa: BLE001 - a loop's error was already logged by it
                pass
        client.close()
        if cluster is not None:
            cluster.close()
        if not redis_down:
            queue.clear()
    return run.write_summary(cfg.schedule.mode)
