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
from digen.errors import DigenError
from digen.iteration import IterationBook
from digen.rollout import GroupTask, Trajectories, plan_groups
from digen.rundir import RunDir
from digen.runtime.cluster import WorkerInfo, connect_scheduler, list_workers, start_local_cluster
from digen.runtime.jobstate import JobState
from digen.runtime.queue import TaskQueue
from digen.runtime.redis_conn import connect, embedded_url
from digen.trainer import ProgressFn, build_policy, open_store, save_checkpoint, timing_metrics
from digen.training import TrainStats
from digen.viz import write_sample_grid

log = logging.getLogger(__name__)


class JobCancelled(DigenError):
    exit_code = 1


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

    # --- set-up -----------------------------------------------------------------------
    def role_of(self, w: WorkerInfo) -> Role:
        return Role.COLOCATED if self.cfg.schedule.mode == "colocated" else w.role

    def sync_workers(self, sched: Scheduler, now: float) -> list[Instruction]:
        """Workers that joined or left since the last look, as scheduler events. A worker
        restarted under the same name (a Nanny restart: new address) left and joined again:
        its leased tasks are re-queued and it gets a fresh loop."""
        seen = {w.name: w for w in list_workers(self.client)}
        out: list[Instruction] = []
        for name in list(self.workers):
            if name not in seen or seen[name].address != self.workers[name].address:
                del self.workers[name]
                self.loops.pop(name, None)
                out += sched.handle(WorkerLeft(name, now))
        for name, w in seen.items():
            if name not in self.workers:
                self.workers[name] = w
                out += sched.handle(WorkerJoined(name, self.role_of(w), w.gpu_type, now))
                self.start_loop(w)
        for name, fut in list(self.loops.items()):  # a loop that crashed on a live worker restarts
            if fut.status == "error":
                log.warning("worker loop on %s failed (%s); restarting it", name, fut.exception())
                self.start_loop(seen[name])
        return out

    def start_loop(self, w: WorkerInfo) -> None:
        from workers.loop import worker_loop

        self.loops[w.name] = self.client.submit(
            worker_loop, self.job.job_id, self.redis_url, self.cfg.model_dump(mode="json"),
            workers=[w.address], allow_other_workers=False, pure=False,
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
                self.release(ins, prompts, store)
            elif isinstance(ins, SetRole):
                self.job.set_tag(ins.worker, ins.role, ins.gen_budget)
            elif isinstance(ins, RequeueWorker):
                lost = self.queue.requeue_worker(ins.worker)
                if lost:
                    log.warning("worker %s left; re-queued %s", ins.worker, lost)
            elif isinstance(ins, Step):
                pending += self.step(sched, ins.iteration, store)
            elif isinstance(ins, Finish):
                finished = True
        return finished

    def book(self, iteration: int, prompts: list[str]) -> IterationBook:
        if iteration not in self.books:
            version = max(0, iteration - int(self.cfg.schedule.resolved().max_staleness or 0))
            self.books[iteration] = IterationBook(self.cfg, iteration, plan_groups(self.cfg, prompts, iteration,
                                                                                     version))
        return self.books[iteration]

    def release(self, ins: Release, prompts: list[str], store) -> None:
        t = ins.task
        book = self.book(t.iteration, prompts)
        if t.kind is TaskKind.GEN:
            task = book.groups[t.group]
            assert task.version == ins.version, (task.version, ins.version)
            self.queue.put("gen", t.id, {"task": task.to_json()})
        else:
            spec = book.train_spec(t.group)
            self.queue.put("train", t.id, {"spec": spec.to_json(), "prompt": book.groups[t.group].prompt,
                                           "tsp": bool(self.cfg.schedule.resolved().tsp)})

    def step(self, sched: Scheduler, iteration: int, store) -> list[Instruction]:
        """Sum the iteration's gradients, step AdamW, publish the next version, log."""
        book = self.books[iteration]
        t0 = time.time()
        grad, rows = book.gradient()
        previous = store.weights()
        opt_stats = store.step(grad, rows)
        t1 = time.time()
        self.job.publish(store.version, store.weights())
        self.job.drop_weights_before(store.version - 1 - int(self.cfg.schedule.resolved().max_staleness or 0))
        t2 = time.time()
        ctl = {"worker": "controller", "gpu_type": "cpu", "role": "controller", "iteration": iteration}
        self.events += [{**ctl, "kind": "optim", "version": store.version - 1, "start": t0, "end": t1},
                        {**ctl, "kind": "sync", "version": store.version, "start": t1, "end": t2}]
        self.finish_iteration(book, opt_stats, store, previous, t2)
        return sched.handle(StepDone(iteration, t0, t2))

    def finish_iteration(self, book: IterationBook, opt_stats: dict, store, previous, now: float) -> None:
        k = book.iteration
        window = [e for e in self.events if e["end"] > self.window_start and e["worker"] != "controller"]
        busy = sum(min(e["end"], now) - max(e["start"], self.window_start) for e in window
                   if e["kind"] != "sync")
        wall = now - self.window_start
        metrics = book.metrics()
        metrics.update(opt_stats)
        n_workers = max(len(self.workers), 1)
        metrics.update(timing_metrics([], n_workers, wall, metrics["samples"]))
        metrics["busy_s"] = busy
        metrics["bubble_ratio"] = max(0.0, 1 - busy / (n_workers * wall)) if wall > 0 else 0.0
        lags = [k - v for v in self.gen_versions.get(k, {}).values()]
        metrics.update({"policy_version": store.version, "max_staleness": max(lags) if lags else 0,
                        "workers": n_workers})
        it_events = [e for e in self.events if e["iteration"] == k]
        self.run.append("timeline.jsonl", it_events)
        self.events = [e for e in self.events if e["iteration"] != k]
        self.run.append("metrics.jsonl", [metrics])
        cfg = self.cfg
        if cfg.output.sample_grid_every and (k % cfg.output.sample_grid_every == 0 or k == cfg.iterations - 1):
            trajs = {}
            for g in book.groups:
                data = self.job.data(TaskRef(TaskKind.GEN, k, g.group).id)
                if data is not None:
                    trajs[g.group] = Trajectories.from_tensors(g, data)
            write_sample_grid(self.run.samples / f"iter_{k:04d}.png", trajs, book.groups)
        if (k + 1) % cfg.output.checkpoint_every == 0 or k == cfg.iterations - 1:
            lag = int(cfg.schedule.resolved().max_staleness or 0)
            save_checkpoint(self.run, store, k, previous if lag else None)
        self.job.drop_data([TaskRef(kind, k, g.group).id for g in book.groups for kind in TaskKind])
        del self.books[k]
        self.gen_versions.pop(k, None)
        self.window_start = now
        if self.progress is not None:
            self.progress(metrics)

    # --- results ----------------------------------------------------------------------
    def collect(self, sched: Scheduler, task_id: str) -> list[Instruction]:
        ref = TaskRef.parse(task_id)
        res = self.queue.get_result(task_id)
        if not isinstance(res, dict) or ref.iteration not in self.books:
            return []
        book = self.books[ref.iteration]
        self.events += res["events"]
        if ref.kind is TaskKind.GEN:
            book.add_rewards(ref.group, torch.tensor(res["rewards"], dtype=torch.float32))
            self.gen_versions.setdefault(ref.iteration, {})[ref.group] = book.groups[ref.group].version
        else:
            book.add_gradient(ref.group, self.job.data(task_id), TrainStats.from_json(res["stats"]))
        return sched.handle(TaskDone(ref, res["worker"], res["start"], res["end"]))


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
    """Run a job in ``colocated``, ``disaggregated`` or ``digen`` mode; returns the summary."""
    s = cfg.schedule.resolved()
    run = RunDir(out, cfg, resume=resume)
    r = connect(redis_url)
    url = redis_url or embedded_url(r)
    job_id = job_id or uuid.uuid4().hex[:12]
    queue, job = TaskQueue(r, job_id, lease_s=s.lease_s), JobState(r, job_id)
    queue.clear()
    torch.manual_seed(cfg.seed)  # the LoRA init draws from it, exactly as in the reference
    policy = build_policy(cfg, device="cpu")
    state = open_store(cfg, run, policy, resume)
    del policy
    store = state.store
    job.publish(store.version, store.weights())
    if state.previous_weights is not None:
        job.publish(store.version - 1, state.previous_weights)
    job.set_status("running")

    cluster = None
    if scheduler is None:
        cl = cfg.cluster.local
        n_roll, n_train = cl.rollout_workers, cl.trainer_workers
        cluster, client = start_local_cluster(n_roll, n_train, cl.gpu_type, cl.threads_per_worker)
    else:
        client = connect_scheduler(scheduler)
    ctl = Controller(cfg, run, queue, job, client, url, progress, cluster=cluster)
    groups = cfg.rollout.prompts_per_iteration
    sched = Scheduler(SchedulerConfig(
        iterations=cfg.iterations, groups=groups, gap=bool(s.gap), tag=bool(s.tag),
        max_staleness=int(s.max_staleness or 0), group_local_advantages=not cfg.train.global_std,
        start_iteration=state.start_iteration,
    ))
    prompts = cfg.prompt_list()
    try:
        ctl.sync_workers(sched, time.time())
        if progress is not None:
            progress({"event": "start", "dashboard": getattr(client, "dashboard_link", None),
                      "roles": {n: ctl.role_of(w).value for n, w in ctl.workers.items()}})
        if on_start is not None:
            on_start(ctl)
        ctl.window_start = time.time()
        finished = ctl.apply(sched, sched.start(time.time()), prompts, store)
        last_check = time.time()
        while not finished:
            ids = queue.pop_done(timeout_s=0.05)
            instructions: list[Instruction] = []
            for tid in ids:
                instructions += ctl.collect(sched, tid)
            now = time.time()
            if now - last_check > 0.5:
                last_check = now
                instructions += ctl.sync_workers(sched, now)
                queue.requeue_expired(max_attempts=s.max_attempts)
                dead = queue.dead_letters()
                if dead:
                    d = dead[0]
                    raise DigenError(f"task {d.task_id} failed {d.attempts} times: {d.error.splitlines()[0]}")
                if job.status() == "cancel":
                    raise JobCancelled(f"job {job_id} cancelled; the last checkpoint is kept in {out}")
            finished = ctl.apply(sched, instructions, prompts, store)
        job.set_status("done")
    except BaseException:
        job.set_status("failed" if job.status() != "cancel" else "cancelled")
        raise
    finally:
        for fut in ctl.loops.values():
            try:
                fut.result(timeout=30)
            except Exception:  # noqa: BLE001 - a loop's error was already logged by it
                pass
        client.close()
        if cluster is not None:
            cluster.close()
        queue.clear()
    return run.write_summary(cfg.schedule.mode)
