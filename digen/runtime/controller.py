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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import redis
import torch

from digen.assembly import build_policy, build_reward, compute_threads
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
from digen.errors import ConfigError, ConnectionFailure, DigenError, JobCancelled
from digen.evaluation import eval_task_count, held_out_prompts
from digen.iteration import IterationBook, ProgressFn, timing_metrics
from digen.optim import ParameterStore, open_store, save_checkpoint
from digen.rollout import Trajectories, plan_groups
from digen.rundir import RunDir
from digen.runtime.cluster import (
    LocalClusterStart,
    WorkerInfo,
    close_local_cluster,
    connect_scheduler,
    list_workers,
)
from digen.runtime.evals import Evaluations
from digen.runtime.fsdp_group import FsdpControl, ShardedStore, is_step_id
from digen.runtime.jobstate import JobState
from digen.runtime.queue import DeadLetter, TaskQueue
from digen.runtime.redis_conn import SecretURL, connect, embedded_url, mask_url
from digen.runtime.sp_group import SpControl, SpGroup
from digen.startup import add_worker_notes, phase
from digen.training import TrainStats
from digen.viz import write_sample_grid

log = logging.getLogger(__name__)


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
    released_at: dict[str, float] = field(default_factory=dict)
    """When each outstanding task went into its queue (controller clock): its timeline rows get
    it as ``released`` (:func:`digen.evaluation.eval_interference` reads the waits)."""
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
    evals: Evaluations | None = None
    """Held-out evaluation (``eval.every``): its tasks' payloads and results."""
    sp: SpControl | None = None
    """With ``rollout.sequence_parallel`` > 1: the replicas (digen.runtime.sp_group)."""

    # --- set-up -----------------------------------------------------------------------
    def role_of(self, w: WorkerInfo) -> Role:
        if w.role is Role.REWARD:  # scores in every mode
            return w.role
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
        if t.kind is TaskKind.EVAL:
            assert self.evals is not None
            return self.put(t, "eval", self.evals.payload(t))
        book = self.book(t.iteration, prompts)
        if t.kind is TaskKind.GEN:
            task = book.groups[t.group]
            assert task.version == ins.version, (task.version, ins.version)
            queue, payload = "gen", {"task": task.to_json(), "score": not sched.reward_tasks}
        elif t.kind is TaskKind.REWARD:
            if TaskRef(TaskKind.GEN, t.iteration, t.group).id in self.dead.get(t.iteration, []):
                return sched.handle(TaskDone(t, "", time.time(), time.time()))  # NaN rewards already
            queue, payload = "reward", {"task": book.groups[t.group].to_json()}
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
        return self.put(t, queue, payload)

    def put(self, t: TaskRef, queue: str, payload: dict) -> list[Instruction]:
        self.outstanding[t.id] = (queue, payload)
        self.queue.put(queue, t.id, payload)
        self.released_at.setdefault(t.id, time.time())  # after the put: a later lease saw it queued
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
        oldest = store.version - 1 - lag
        keep = self.evals.keep_from(oldest, sched.evals_waiting) if self.evals else oldest
        self.job.drop_weights_before(keep)
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
        window += in_flight_events(self.queue, list(self.outstanding), now)  # next iteration's, under GAP
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
        metrics.update(
            timing_metrics(window, n_workers, wall, metrics["samples"], window=(self.window_start, now))
        )
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
                    trajs[g.group].rewards = book.rewards.get(g.group, trajs[g.group].rewards)
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

    def cancel(self) -> JobCancelled:
        """Stop releasing and tell the worker loops to drop their work (the job's status
        leaves ``running``); the error to raise, naming the checkpoint kept."""
        self.job.set_status("cancel")
        ckpt = self.run.latest_checkpoint()
        kept = f"the checkpoint {ckpt} is kept" if ckpt is not None else "no iteration had finished"
        unfinished = sorted(self.books)
        during = f" during iteration {unfinished[0]}" if unfinished else ""
        return JobCancelled(f"job {self.job.job_id} cancelled{during}; {kept}: continue it with --resume")

    # --- results ----------------------------------------------------------------------
    def collect(self, sched: Scheduler, task_id: str) -> list[Instruction]:
        """Count an acknowledged task's result, once."""
        if task_id in self.collected:
            return []
        if self.fsdp is not None and is_step_id(task_id):
            return self.fsdp.collect_step(self, sched, task_id)
        ref = TaskRef.parse(task_id)
        res = self.queue.get_result(task_id)
        if ref.kind is TaskKind.EVAL:
            return self.collect_eval(sched, ref, res)
        if not isinstance(res, dict) or ref.iteration not in self.books:
            return []
        self.collected.add(task_id)
        self.outstanding.pop(task_id, None)
        self.loop_failures.pop(res["worker"], None)
        book = self.books[ref.iteration]
        self.events += self.stamp(task_id, res["events"])
        if ref.kind is TaskKind.GEN:
            if not sched.reward_tasks:
                book.add_rewards(ref.group, torch.tensor(res["rewards"], dtype=torch.float32))
            self.gen_versions.setdefault(ref.iteration, {})[ref.group] = book.groups[ref.group].version
        elif ref.kind is TaskKind.REWARD:
            book.add_rewards(ref.group, torch.tensor(res["rewards"], dtype=torch.float32))
        else:
            grads = {} if self.fsdp is not None else self.job.data(task_id)  # FSDP: it stays sharded
            book.add_gradient(ref.group, grads, TrainStats.from_json(res["stats"]), ref.part)
        return sched.handle(TaskDone(ref, res["worker"], res["start"], res["end"]))

    def stamp(self, task_id: str, events: list[dict]) -> list[dict]:
        """Mark a collected task's timeline rows with its id (``task``) and release time."""
        released = self.released_at.pop(task_id, None)
        for e in events:
            e["task"] = task_id
            if released is not None:
                e["released"] = released
        return events

    def collect_eval(self, sched: Scheduler, ref: TaskRef, res) -> list[Instruction]:
        """An ``eval`` task's scores and images; its evaluation's timeline rows are written
        when it completes (an evaluation runs after its iteration's rows are out)."""
        if not isinstance(res, dict) or self.evals is None or not self.evals.pending(ref):
            return []
        self.collected.add(ref.id)
        self.outstanding.pop(ref.id, None)
        self.stamp(ref.id, res["events"])
        self.run.append("timeline.jsonl", self.evals.collect(ref, res))
        return sched.handle(TaskDone(ref, res["worker"], res["start"], res["end"]))

    def poisoned(self, sched: Scheduler, dead: DeadLetter, store) -> list[Instruction]:
        """A task that failed ``schedule.max_attempts`` times (its error is in
        ``dead_letters.jsonl``): fail the job, or (``on_poison: drop``) drop its samples: a dead
        generation task's samples count as dropped (NaN rewards) and its group trains nothing;
        a dead train task's group adds a zero gradient and its samples do not count."""
        if dead.task_id in self.dead_seen:
            return []
        self.dead_seen.add(dead.task_id)
        self.released_at.pop(dead.task_id, None)
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
        if "RewardServiceDown" in first:  # not this task's fault: no task would score
            raise PoisonTask(f"task {dead.task_id} failed: {first.split(': ', 1)[-1]}")
        if action == "fail":
            raise PoisonTask(
                f"task {dead.task_id} failed {dead.attempts} time(s): {first}; fix the cause and rerun "
                f"with --resume, or set schedule.on_poison=drop to drop such samples"
            )
        ref = TaskRef.parse(dead.task_id)
        if ref.kind is TaskKind.EVAL and self.evals is not None and self.evals.pending(ref):
            self.outstanding.pop(dead.task_id, None)
            self.run.append("timeline.jsonl", self.evals.drop(ref))
            return sched.handle(TaskDone(ref, "", time.time(), time.time()))
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
        if ref.kind in (TaskKind.GEN, TaskKind.REWARD):
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
        if self.job.status() is None:  # written at the start and never deleted while the job runs
            raise ConnectionFailure(
                f"Redis lost the job's data (restarted without persistence); the last checkpoint is kept "
                f"in {self.run.root}: rerun with --resume"
            )
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


def in_flight_events(queue: TaskQueue, task_ids: list[str], now: float) -> list[dict]:
    """Busy spans of released tasks whose results are not collected yet, for the bubble ratio
    of the window ending at ``now``: a leased task as one span from its lease (the worker's
    clock) to ``now``, an acknowledged one by its result's events. A task straddling the
    iteration boundary counts in both windows, each time clipped to that window
    (:func:`~digen.iteration.busy_seconds`); a pending one has not run."""
    out: list[dict] = []
    for tid, (state, started) in queue.progress(task_ids).items():
        if state == "leased" and started is not None:
            out.append({"kind": "task", "start": started, "end": now})
        elif state == "done" and isinstance(res := queue.get_result(tid), dict):
            out += [e for e in res.get("events", []) if e["start"] < now]
    return out


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


def _local_cluster(cfg: Config) -> LocalClusterStart:
    """Start the embedded local cluster of ``cluster.local`` (in a thread; see LocalClusterStart)."""
    cl = cfg.cluster.local
    return LocalClusterStart(
        cl.rollout_workers,
        cl.trainer_workers,
        cl.gpu_type,
        cl.threads_per_worker,
        cl.start_method,
        cfg.model_dump(mode="json"),
        reward=cl.reward_workers,
        dashboard=cl.dashboard,
    )


def _own_initial(cfg: Config) -> Callable[[], dict[str, torch.Tensor]]:
    """Version 0 of the trained tensors from this process's own seeded CPU build (an external
    cluster's workers may not have joined yet)."""

    def build() -> dict[str, torch.Tensor]:
        return build_policy(cfg, device="cpu").trainable_state_dict()

    return build


def _worker_initial(cfg: Config, client) -> Callable[[], dict[str, torch.Tensor]]:
    """Version 0 of the trained tensors from the first policy-holding local worker, which
    draws them as the reference does (:func:`workers.preload.initial_weights`)."""

    def fetch() -> dict[str, torch.Tensor]:
        from safetensors.torch import load

        from workers.preload import initial_weights

        w = next((w for w in list_workers(client) if w.role is not Role.REWARD), None)
        if w is None:  # reward workers only: nothing holds the policy
            return _own_initial(cfg)()
        threads = cfg.cluster.local.threads_per_worker
        blob = client.submit(
            initial_weights, cfg.model_dump(mode="json"), threads, workers=[w.address], pure=False
        ).result()
        return load(blob)

    return fetch


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
    cancelled: Callable[[], bool] | None = None,
) -> dict:
    """Run a job in ``colocated``, ``disaggregated`` or ``digen`` mode; returns the summary.

    ``cancelled()`` (``digen cancel``; also the job's Redis status ``cancel``) is checked each
    time the controller has collected what the workers acknowledged, before it releases
    anything: a cancelled job stops mid-iteration, the worker loops drop their task (between
    denoising steps, or after the task in hand) and :class:`JobCancelled` is raised, the run
    directory holding the last complete iteration's checkpoint.

    Inputs are checked before anything is written or started (rewards, Redis, the Dask
    scheduler: errors within seconds, naming what and where). A Redis restart pauses the job
    for up to ``schedule.redis_outage_s``, then it continues (see docs/guarantees.md).
    """
    s = cfg.schedule.resolved()
    preflight(cfg, local=scheduler is None)
    with phase("redis start"):
        r = connect(redis_url, outage_s=s.redis_outage_s)
    url = redis_url or embedded_url(r)
    client = connect_scheduler(scheduler, timeout_s=5.0) if scheduler is not None else None
    run = RunDir(out, cfg, resume=resume)
    job_id = job_id or uuid.uuid4().hex[:12]
    queue, job = TaskQueue(r, job_id, lease_s=s.lease_s), JobState(r, job_id)
    queue.on_junk = lambda record: run.append("dead_letters.jsonl", [record])  # quarantined junk
    queue.clear()
    # the local cluster starts, and its workers load their models; the version-0 weights come
    # from one of them (workers.preload.initial_weights): this process loads no model
    starting = None if client is not None else _local_cluster(cfg)
    try:
        cluster = None
        if starting is not None:
            cluster, client = starting.result()
        with phase("controller model load"):
            initial = _worker_initial(cfg, client) if starting is not None else _own_initial(cfg)
            # with FSDP the trainer group owns the optimizer: the controller keeps the weights only
            state = open_store(cfg, run, initial, resume, ShardedStore if cfg.train.fsdp else ParameterStore)
        store = state.store
        fsdp = FsdpControl.create(queue, job, store) if cfg.train.fsdp else None
        job.publish(store.version, store.weights())
        if state.previous_weights is not None:
            job.publish(store.version - 1, state.previous_weights)
        job.set_status("running")
    except BaseException:
        if starting is not None:
            starting.discard()
        raise
    ctl = Controller(
        cfg, run, queue, job, client, url, progress, cluster=cluster, previous_weights=state.previous_weights
    )
    ctl.fsdp = fsdp
    if cfg.eval.every:
        ctl.evals = Evaluations(cfg, run, job, held_out_prompts(cfg), progress)
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
            eval_every=cfg.eval.every,
            eval_tasks=eval_task_count(cfg),
            task_seconds={TaskKind(k): v for k, v in s.task_seconds.items()},
        )
    )
    prompts = cfg.prompt_list()
    retry = r.get_retry()
    redis_down = False
    try:
        ctl.sync_workers(sched, time.time())
        ctl.check_gpu_types()
        local = cfg.cluster.local
        n_local = local.rollout_workers + local.trainer_workers + local.reward_workers
        with phase("workers ready"):
            ctl.wait_ready(sched, expected=n_local if cluster else 0)
        add_worker_notes(job.startup_notes())
        if fsdp is not None:
            fsdp.start(ctl, run.latest_checkpoint() if resume else None)
        if cfg.rollout.sequence_parallel > 1:
            ctl.sp = SpControl(SpGroup(r, job_id), cfg.rollout.sequence_parallel)
            ctl.sp.start(ctl, sched, time.time())
        if progress is not None:
            progress(
                {
                    "event": "start",
                    # a local cluster without the dashboard still serves Dask's plain HTTP routes
                    "dashboard": getattr(client, "dashboard_link", None)
                    if scheduler is not None or cfg.cluster.local.dashboard
                    else None,
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
            if job.status() == "cancel" or (cancelled is not None and cancelled()):
                raise ctl.cancel()
            now = time.time()
            if now - last_check > 0.5:
                last_check = now
                if getattr(retry, "outages", 0) != outages:
                    outages = retry.outages
                    ctl.reconcile(store)
                if fsdp is not None:
                    fsdp.check(ctl)
                instructions += ctl.sync_workers(sched, now)
                if ctl.sp is not None:
                    instructions += ctl.sp.check(ctl, sched, now)
                queue.requeue_expired(max_attempts=s.max_attempts)
                for dead in queue.dead_letters():
                    instructions += ctl.poisoned(sched, dead, store)
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
            close_local_cluster(cluster)
        if not redis_down:
            queue.clear()
    return run.write_summary(cfg.schedule.mode)
