"""The controller: drives a job's :class:`Scheduler` with events from Redis and Dask.

Everything it decides comes from the scheduler; it holds no tensor (gradients, weights and
trajectories go worker to worker: :mod:`digen.dataplane`). Its four jobs each have a module:

- who works on the job: :class:`~digen.runtime.membership.Membership` (loops, restarts);
- carrying out instructions: :class:`~digen.runtime.dispatch.Dispatcher` (queues, tags);
- results coming back: :class:`~digen.runtime.results.Collector` (acks, dead letters, lost data);
- optimizer steps and the end of an iteration: the trainer group, a
  :class:`~digen.runtime.steps.StepGroup` (replicated: :class:`~digen.runtime.steps.StepControl`;
  FSDP: :class:`~digen.runtime.fsdp_group.FsdpControl`), and :meth:`Controller.end_iteration`
  (the metrics row, timeline, grid and checkpoint, written with the reference loop's
  :func:`~digen.iteration.finish_iteration`).

:class:`Controller` wires them to the scheduler and runs the loop: collect what the workers
acknowledged -> events -> instructions -> Redis, with a slower look every half second at the
cluster, expired leases, dead letters and parked tasks.
"""

from __future__ import annotations

import json
import logging
import math
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import redis

from digen.checks import registries_apart
from digen.cluster.cluster import (
    LocalClusterStart,
    connect_scheduler,
    exit_process,
    run_worker_loop,
)
from digen.cluster.node import dask_security
from digen.cluster.placement import Placement, plan_local
from digen.config import Config
from digen.controlplane.jobstate import JobState
from digen.controlplane.messages import StepAck, result_type
from digen.controlplane.queue import TaskQueue, is_step_id
from digen.controlplane.redis_conn import connect, embedded_url, mask_url
from digen.controlplane.sp_keys import SpGroup
from digen.controlplane.trainer_group import TrainerGroup
from digen.core.events import (
    Event,
    Finish,
    Instruction,
    Release,
    RequeueWorker,
    SetRole,
    Step,
    StepDone,
    TaskKind,
    TrainLost,
    WorkerLeft,
)
from digen.core.scheduler import Scheduler, SchedulerConfig
from digen.core.timeline import TimelineRow
from digen.core.versions import iterations_behind
from digen.errors import ConfigError, ConnectionFailure, JobCancelled, PayloadError
from digen.evaluation import eval_task_count, held_out_prompts
from digen.iteration import IterationEnd, ProgressFn, finish_iteration, within_iteration
from digen.rundir import RunDir, checkpoint_advice, finalize_checkpoint
from digen.runtime.dispatch import Dispatcher
from digen.runtime.evals import Evaluations
from digen.runtime.fsdp_group import FsdpControl
from digen.runtime.ledger import Ledger
from digen.runtime.membership import Membership
from digen.runtime.results import Collector, PoisonTask
from digen.runtime.sp_group import SpControl
from digen.runtime.steps import StepControl, StepGroup, StepResult
from digen.startup import add_worker_notes, phase
from digen.viz import GridRow, from_png

log = logging.getLogger(__name__)

__all__ = ["Controller", "PoisonTask", "run_distributed"]

CHECK_S = 0.5
"""How often the controller looks at the cluster, expired leases, dead letters, parked tasks,
the step in flight and ``digen cancel``."""
COLLECT_WAIT_S = 0.25
"""How long the controller waits for an acknowledgement before its other business (an
acknowledgement wakes it at once)."""
INTERRUPT_WAIT_S = 3.0
"""After a Ctrl-C, how long the controller waits, in all, for the worker loops to return
(each drops its task between denoising steps, or after the task in hand) before it closes the
cluster, which ends those still busy: the job stops within a few seconds."""
LOOP_WAIT_S = 30.0
"""At the end of a job that was not interrupted, how long the controller waits for each worker
loop to return (a loop returns within the task in hand)."""


@dataclass
class Controller:
    cfg: Config
    run: RunDir
    queue: TaskQueue
    job: JobState
    sched: Scheduler
    members: Membership
    ledger: Ledger
    dispatch: Dispatcher
    results: Collector
    group: StepGroup
    """The trainer group: replicated (:class:`StepControl`) or FSDP (:class:`FsdpControl`)."""
    progress: ProgressFn | None = None
    evals: Evaluations | None = None
    sp: SpControl | None = None
    cluster: object = None
    """The local Dask cluster when digen started one (tests scale it)."""
    window_start: float = 0.0
    waiting_step: tuple[int, int] | None = None
    """(iteration, mini-batch) of a step that waits for a member of the trainer group to be there."""
    grad_norms: list[float] = field(default_factory=list)
    """The grad norms of the current iteration's steps so far (``train.mini_batches`` > 1)."""
    backlog: list[str] = field(default_factory=list)
    """Done tasks found by a reconciliation, collected with the next done ids."""
    last_within: dict | None = None
    """The last within-iteration progress reported (:meth:`report_within`)."""

    @property
    def client(self):
        return self.members.client

    @property
    def workers(self):
        return self.members.workers

    # --- events and instructions ------------------------------------------------------------
    def handle(self, events: list[Event]) -> list[Instruction]:
        """Feed events to the scheduler; a worker that left also takes its data with it (but
        for the step in flight's gradients: its decision settles them). Train tasks to run
        again cancel a step waiting for a member: the scheduler asks for it once they are done."""
        out: list[Instruction] = []
        pending = list(events)
        while pending:
            ev = pending.pop(0)
            out += self.sched.handle(ev)
            if isinstance(ev, WorkerLeft) and (keep := self.group.settle_departure(ev.worker)) is not None:
                pending += self.results.worker_left(ev.worker, ev.t, keep=keep)
            elif (
                isinstance(ev, TrainLost)
                and self.waiting_step is not None
                and ev.iteration == self.waiting_step[0]
            ):
                self.waiting_step = None
        return out

    def take(self, events: list[Event]) -> None:
        """Events from outside the loop (start-up): handled and their instructions applied,
        none dropped; none may finish the job (the scheduler has not started)."""
        finished = self.apply(self.handle(events))
        assert not finished, "the job finished before its scheduler started"

    def apply(self, instructions: list[Instruction]) -> bool:
        """Carry out instructions (some feed events back). True once finished. An instruction
        the controller has no handler for is a bug between the scheduler and it: a TypeError
        naming it, never silently dropped (as dask's worker state machine does)."""
        pending = list(instructions)
        finished = False
        with self.dispatch.together():  # an iteration's generation tasks queued at once
            while pending:
                match ins := pending.pop(0):
                    case Release():
                        done = self.dispatch.release(ins)
                        if done is not None:
                            pending += self.handle([done])
                    case SetRole():
                        self.dispatch.set_role(ins.worker, ins.role, ins.budget)
                    case RequeueWorker():
                        self.dispatch.requeue_worker(ins.worker)
                    case Step():
                        self.ask_step(ins.iteration, ins.mini_batch)
                    case Finish():
                        finished = True
                    case _:
                        raise TypeError(f"the controller has no handler for instruction {ins!r}")
        return finished

    def ask_step(self, iteration: int, mini_batch: int = 0) -> None:
        if self.group.ask(iteration, mini_batch, self.members, self.oldest_needed):
            self.waiting_step = None
        else:
            if self.waiting_step != (iteration, mini_batch):
                log.warning("iteration %d's step waits for a trainer to join", iteration)
            self.waiting_step = (iteration, mini_batch)

    def oldest_needed(self, oldest: int) -> int:
        """The oldest weight version the trainers must keep serving through a step: ``oldest``
        (the step group's own choice: the current version, or at staleness 1 the one the next
        iteration generates with), or an older one that generation not yet done will load
        (:meth:`~digen.runtime.ledger.Ledger.generation_versions`) or an evaluation still waits
        for (:meth:`~digen.runtime.evals.Evaluations.keep_from`)."""
        needed = [oldest, *self.ledger.generation_versions()]
        if self.evals is not None:
            needed.append(self.evals.keep_from(oldest, self.sched.evals_waiting))
        return min(needed)

    def collect(self, task_id: str) -> list[Instruction]:
        raw = self.queue.raw_result(task_id)
        res = self.results.read(task_id, raw)  # junk: quarantined, None
        if is_step_id(task_id):
            return self.collect_step(task_id, raw, res if isinstance(res, StepAck) else None)
        events = self.results.collect(task_id, res)
        if events and res is not None:
            self.members.task_done(res.worker)
        instructions = self.handle(events)
        self.report_within()
        return instructions

    def collect_step(self, task_id: str, raw: bytes | None, ack: StepAck | None) -> list[Instruction]:
        """The acknowledgement ``ack`` of step ``task_id`` (read from ``raw``; None: none, or
        junk, quarantined). One that names another version than the step makes is junk too
        (quarantined and counted: a second step, or a forged acknowledgement, never moves the
        controller's version); for junk the group is asked to acknowledge the step again."""
        want = self.group.makes_version(task_id)
        if ack is not None and want is not None and ack.version != want:
            why = f"the stored result of task {task_id}: a StepAck of version {ack.version}, the step makes {want}"
            self.queue.quarantine(f"result:{task_id}", raw, why)
            ack = None
        if ack is None:
            if raw is not None:
                self.group.ask_again(task_id)
            return []
        step = self.group.collect(task_id, ack)
        if step is None:
            return []
        return self.end_iteration(step) if step.last_of_iteration else self.mini_batch_done(step)

    def report_within(self) -> None:
        """Tell the progress display where the oldest open iteration stands (samples
        generated and trained, :func:`~digen.iteration.within_iteration`), when that changed."""
        if self.progress is None or not self.ledger.books:
            return
        now = within_iteration(self.ledger.books[min(self.ledger.books)])
        if now != self.last_within:
            self.last_within = now
            self.progress(now)

    # --- the end of an iteration ------------------------------------------------------------
    def mini_batch_done(self, step: StepResult) -> list[Instruction]:
        """A step before the iteration's last (``train.mini_batches`` > 1): its numbers wait
        for the iteration's row; the scheduler releases the next mini-batch's train tasks."""
        for e in step.events:
            e.setdefault("iteration", step.iteration)
        self.ledger.events += step.events
        self.grad_norms.append(float(step.stats["grad_norm"]))
        return self.handle([StepDone(step.iteration, step.asked, time.time(), mini_batch=step.mini_batch)])

    def end_iteration(self, step: StepResult) -> list[Instruction]:
        """Record iteration ``step.iteration`` (metrics, timeline, grid), put its staged
        checkpoint in place, tell the workers, and the scheduler."""
        k, led, now = step.iteration, self.ledger, time.time()
        book = led.books[k]
        for e in step.events:
            e.setdefault("iteration", k)
        led.events += step.events
        window = [e for e in led.events if e["end"] > self.window_start and e["role"] != "controller"]
        window += in_flight_events(self.queue, list(led.outstanding), now)  # next iteration's, under GAP
        never = self.group.settle(k)
        if never:
            log.warning(
                "iteration %d: train tasks %s are in no committed step; their samples count as dropped",
                k,
                ", ".join(never),
            )
        dead = led.dead.pop(k, [])
        dropped = sum(len(x.samples) for g, p in led.untrained.pop(k, set()) for x in book.task_specs(g, p))
        m_total = self.cfg.train.mini_batches
        lags = [iterations_behind(k, v, m_total) for v in led.gen_versions.get(k, {}).values()]
        stats = dict(step.stats)
        if self.grad_norms:  # one per optimizer step, as the reference loop reports them
            norms = [*self.grad_norms, float(stats["grad_norm"])]
            stats.update(grad_norm=sum(norms) / len(norms), grad_norms=norms)
            self.grad_norms = []
        grid = None
        if k in led.cells:
            grid = [
                GridRow(
                    g,
                    book.groups[g].prompt,
                    book.groups[g].version,
                    [float(x) for x in book.rewards[g]],
                    from_png(c),
                )
                for g, c in sorted(led.cells[k].items())
                if g in book.rewards
            ]
        end = IterationEnd(
            stats,
            step.version,
            max(lags) if lags else 0,
            max(len(self.workers), 1),
            window,
            now - self.window_start,
            window=(self.window_start, now),
            timeline=[e for e in led.events if e["iteration"] == k],
            grid=grid,
            dropped=dropped,
            dead_tasks=dead,
        )
        metrics = finish_iteration(self.run, book, end)
        led.events = [e for e in led.events if e["iteration"] != k]
        if step.checkpoint is not None:
            finalize_checkpoint(Path(step.checkpoint), self.cfg.output.keep_checkpoints)
        self.group.checkpoint_placed(step.checkpoint)
        self.job.set_stepped(k)
        led.forget(k)
        self.window_start = now
        if self.progress is not None:
            self.progress(metrics)
        return self.handle([StepDone(k, step.asked, now, mini_batch=step.mini_batch)])

    # --- the periodic look ------------------------------------------------------------------
    def check(self, now: float, outage: bool) -> list[Instruction]:
        """What changed besides acknowledgements: the cluster, leases, dead letters, parked
        tasks, the trainer group's step."""
        s = self.cfg.schedule.resolved()
        if outage:
            self.backlog += self.dispatch.reconcile()
            self.group.reconcile()
        events: list[Event] = list(self.members.sync(now))
        instructions = self.handle(events)
        self.group.look(self.members)
        if self.sp is not None:
            instructions += self.sp.check(self.members, self.sched, now)
        self.queue.requeue_expired(max_attempts=s.max_attempts)
        for dead in self.queue.dead_letters():
            instructions += self.handle(self.results.poisoned(dead, self.group.dead_task))
        for task_id, why in self.queue.pop_parked():
            instructions += self.handle(self.results.parked(task_id, why, now))
        if self.waiting_step is not None:
            self.ask_step(*self.waiting_step)
        return instructions + self.check_step(now)

    def check_step(self, now: float) -> list[Instruction]:
        """Watch the trainer group's step in flight (a commit needs nothing from here: the
        writer's acknowledgement ends it; this catches aborts and a writer that left)."""

        def alive() -> dict[str, str]:
            incarnations = self.members.running(list(self.workers))
            return {w: incarnations.get(w, "") for w in self.workers}

        aborted = self.group.watch(alive)
        if aborted is None:
            return []
        iteration, mini_batch, lost = aborted
        if not lost:  # every gradient survived the abort (blobs): ask again, in a new epoch
            self.ask_step(iteration, mini_batch)
            return []
        return self.handle(self.results.train_again(iteration, lost, now, "the step was aborted"))

    def cancel(self) -> JobCancelled:
        """Stop releasing and tell the worker loops to drop their work (the job's status
        leaves ``running``); the error to raise, naming the checkpoint kept."""
        self.job.set_status("cancel")
        self.queue.wake(*self.workers)
        ckpt = self.run.latest_checkpoint()
        kept = f"the checkpoint {ckpt} is kept" if ckpt is not None else "no iteration had finished"
        unfinished = sorted(self.ledger.books)
        during = f" during iteration {unfinished[0]}" if unfinished else ""
        return JobCancelled(f"job {self.job.job_id} cancelled{during}; {kept}: continue it with --resume")

    def loop(self, cancelled: Callable[[], bool] | None, retry) -> None:
        """Run the job to its end (see the module docstring)."""
        start = self.sched.start(time.time())
        self.dispatch.reward_tasks = self.sched.reward_tasks
        finished = self.apply(start)
        last_check, outages = time.time(), getattr(retry, "outages", 0)
        while not finished:
            ids = self.backlog + self.queue.pop_done(timeout_s=COLLECT_WAIT_S)
            self.backlog = []
            instructions: list[Instruction] = []
            for tid in ids:
                instructions += self.collect(tid)
            if cancelled is not None and cancelled():
                raise self.cancel()
            now = time.time()
            if now - last_check > CHECK_S:
                if self.job.status() == "cancel":  # digen cancel, from any process
                    raise self.cancel()
                last_check = now
                outage = getattr(retry, "outages", 0) != outages
                outages = getattr(retry, "outages", 0)
                instructions += self.check(now, outage)
            finished = self.apply(instructions)
        self.queue.dead_letters()  # a last look: junk pushed there near the end is quarantined too


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
        elif state == "done" and (res := _events_of(tid, queue.raw_result(tid))) is not None:
            out += [e.to_json() for e in res if e.start < now]
    return out


def _events_of(task_id: str, raw: object) -> list[TimelineRow] | None:
    """The timeline rows of a stored result (None: none, or one that does not read, which
    :meth:`Controller.collect` quarantines when it comes to it)."""
    if raw is None:
        return None
    try:
        return result_type(task_id).read(raw).events
    except PayloadError:
        return None


def preflight(cfg: Config, local: bool, rewards: bool = True) -> Placement | None:
    """Fail in seconds, before any cluster starts, on a reward that does not exist or takes
    other arguments (:class:`ConfigError`) or whose server does not answer (:class:`RewardError`),
    on a local cluster whose workers do not fit its GPUs (:func:`~digen.cluster.placement.plan_local`)
    and on one on CPU whose GPU type ``cluster.gpu_types`` leaves out. Returns the local
    cluster's placement (None without a local cluster). The rewards are
    built and asked in a child process (:func:`~digen.checks.registries_apart`): their code
    imports torch, which this process does not. ``rewards=False``: they were asked already
    (:func:`~digen.checks.check_inputs` with ``health``, just before)."""
    placement = plan_local(cfg) if local else None
    allowed, gpu = cfg.cluster.gpu_types, cfg.cluster.local.gpu_type
    if placement is not None and placement.cpu_reason is not None and allowed and gpu not in allowed:
        raise ConfigError(
            f"cluster.local.gpu_type ({gpu}) is not in cluster.gpu_types {allowed}: no local worker "
            f"may run a task; add {gpu} to cluster.gpu_types or set cluster.local.gpu_type"
        )
    if rewards and (problems := registries_apart(cfg, [], health=True)):
        raise ConfigError(problems)
    return placement


def with_absolute_security(cfg: Config) -> Config:
    """``cfg`` with its ``security:`` files as absolute paths (relative ones name files next
    to the config): the Dask client, the local cluster and the workers read them."""
    sec = cfg.security
    if not sec.enabled:
        return cfg
    files = {
        name: str(cfg.resolve_path(getattr(sec, name)).resolve())
        for name in ("ca_file", "cert_file", "key_file")
        if getattr(sec, name)
    }
    return cfg.model_copy(update={"security": sec.model_copy(update=files)})


def _local_cluster(cfg: Config, placement: Placement | None = None) -> LocalClusterStart:
    """Start the embedded local cluster of ``cluster.local`` (in a thread; see
    LocalClusterStart), each worker on its GPU of ``placement`` (logged one line per worker).
    Every connection is mutual TLS: with the config's ``security:`` files, else with the job's
    own, made here and removed when the cluster closes (:class:`~digen.cluster.certs.JobCerts`)."""
    from digen.cluster.certs import JobCerts

    cl = cfg.cluster.local
    placement = placement or plan_local(cfg)
    for line in placement.lines():
        log.info("%s", line)
    certs = None if cfg.security.enabled else JobCerts.make()
    return LocalClusterStart(
        cl.rollout_workers,
        cl.trainer_workers,
        cl.gpu_type,
        cl.threads_per_worker,
        cl.start_method,
        cfg.model_dump(mode="json"),
        reward=cl.reward_workers,
        dashboard=cl.dashboard,
        placement=placement,
        security=dask_security(cfg.security if certs is None else certs.security()),
        certs=certs,
    )


def redis_lost(
    url: str, retry: object, *, outage_s: float, exc: BaseException, out: Path
) -> ConnectionFailure:
    """The one line of a job whose Redis is gone: which Redis and how (an embedded server
    that exited, or any Redis unreachable past ``outage_s``), and what the run directory
    keeps (its last checkpoint and ``--resume``, or none and a fresh run). An embedded
    Redis took the job's queue with it: a rerun starts its own."""
    pid = getattr(retry, "pid", None)
    if getattr(retry, "exited", False):
        lost = f"the embedded Redis at {mask_url(url)} (pid {pid}) exited ({type(exc).__name__})"
    else:
        what = "Redis" if pid is None else "the embedded Redis"
        lost = f"{what} at {mask_url(url)} unreachable for more than {outage_s:g} s ({type(exc).__name__})"
    return ConnectionFailure(f"{lost}; {checkpoint_advice(out, once='' if pid else ' once Redis is back')}")


def resume_point(run: RunDir) -> tuple[int, int, str | None]:
    """(first iteration to run, the version it starts from, the checkpoint folder) of a
    resumed run, from the newest checkpoint's ``state.json`` (its rows after it are dropped
    by :meth:`~digen.rundir.RunDir.resumed` once the workers have started from it)."""
    from digen.errors import CheckpointError

    ckpt = run.latest_checkpoint()
    if ckpt is None:
        raise CheckpointError(f"--resume: {run.root} has no checkpoint yet; start without --resume")
    try:
        state = json.loads((ckpt / "state.json").read_text())
        last, version = int(state["iteration"]), int(state["version"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"checkpoint {ckpt} cannot be read ({type(exc).__name__}: {exc}); delete it to resume from the "
            f"one before, or start without --resume"
        ) from None
    return last + 1, version, str(ckpt.resolve())


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
    loop_fn: Callable | None = None,
    rewards_checked: bool = False,
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
    ``loop_fn``: the worker loop to place on each worker (default
    :func:`~digen.cluster.cluster.run_worker_loop`, :func:`digen.workers.loop.worker_loop` imported on
    the worker: this process imports no torch). ``rewards_checked``: the caller ran
    :func:`~digen.checks.check_inputs` with ``health`` just before, so the preflight does not
    ask the rewards again.
    """
    s = cfg.schedule.resolved()
    placement = preflight(cfg, local=scheduler is None, rewards=not rewards_checked)
    cfg = with_absolute_security(cfg)
    with phase("redis start"):
        r = connect(redis_url, outage_s=s.redis_outage_s)
    url = redis_url or embedded_url(r)
    client = (
        connect_scheduler(scheduler, timeout_s=5.0, security=dask_security(cfg.security, "client"))
        if scheduler is not None
        else None
    )
    run = RunDir(out, cfg, resume=resume)
    job_id = job_id or uuid.uuid4().hex[:12]
    queue, job = TaskQueue(r, job_id, lease_s=s.lease_s, issued_only=True), JobState(r, job_id)
    queue.on_junk = lambda record: run.append("dead_letters.jsonl", [record])  # quarantined junk
    queue.clear()
    start_iteration, version, checkpoint = resume_point(run) if resume else (0, 0, None)
    group = TrainerGroup(r, job_id)
    ledger = Ledger(cfg, cfg.prompt_list())
    steps = StepControl(cfg, run, queue, group, ledger, version, checkpoint)
    steps.publish_current()
    job.set_stepped(start_iteration - 1)
    job.blob_key()  # made here, before any worker: the workers' loops read it
    job.set_status("running")
    # the local cluster starts and its workers load their models: each builds version 0
    # itself (digen.assembly.build_policy), or its trainers load the resumed checkpoint
    starting = None if client is not None else _local_cluster(cfg, placement)
    cluster = None
    if starting is not None:
        try:
            cluster, client = starting.result()
        except BaseException:
            starting.discard()
            raise
    assert client is not None  # a scheduler's, or the local cluster's
    members = Membership(cfg, client, job, url, loop_fn or run_worker_loop, exit_process)
    sched = Scheduler(
        SchedulerConfig(
            iterations=cfg.iterations,
            groups=cfg.rollout.prompts_per_iteration,
            gap=bool(s.gap),
            tag=bool(s.tag),
            rat=bool(s.rat),
            max_staleness=int(s.max_staleness or 0),
            group_local_advantages=cfg.train.group_local_advantages,
            start_iteration=start_iteration,
            eval_every=cfg.eval.every,
            eval_tasks=eval_task_count(cfg),
            task_seconds={TaskKind(k): v for k, v in s.task_seconds.items()},
            mini_batches=cfg.train.mini_batches,
            split_samples=cfg.train.mini_batch_split == "samples",
            groups_per_task=cfg.train.groups_per_task,
        )
    )
    evals = Evaluations(cfg, run, job, held_out_prompts(cfg), progress) if cfg.eval.every else None
    dispatch = Dispatcher(ledger, queue, job, evals=evals, run_root=str(out))
    ctl = Controller(
        cfg,
        run,
        queue,
        job,
        sched,
        members,
        ledger,
        dispatch,
        Collector(ledger, queue, run, dispatch, evals),
        steps,
        progress,
        evals=evals,
        cluster=cluster,
    )
    retry = r.get_retry()
    redis_down = interrupted = False
    restore_sigterm = _sigterm_stops(job_id, run)
    try:
        # before the scheduler starts, what joins and leaves is applied like anything else (a
        # worker that left is requeued: nothing of it is queued yet, so nothing moves)
        ctl.take(members.sync(time.time()))
        members.check_gpu_types()
        local = cfg.cluster.local
        n_local = local.rollout_workers + local.trainer_workers + local.reward_workers
        with phase("workers ready"):
            members.wait_ready(ctl.take, expected=n_local if cluster else 0)
        add_worker_notes(job.startup_notes())
        if resume:  # the workers have started from the checkpoint: now the run directory may change
            resumed = run.resumed(start_iteration - 1)
            if progress is not None:
                progress(resumed)
        if cfg.train.fsdp:
            fsdp = FsdpControl.create(queue, job, ledger, run, version, checkpoint)
            fsdp.start(members)
            ctl.group = fsdp
        if cfg.rollout.sequence_parallel > 1:
            ctl.sp = SpControl(SpGroup(r, job_id), cfg.rollout.sequence_parallel)
            ctl.apply(ctl.sp.start(members, sched, time.time()))
        if progress is not None:
            progress(
                {
                    "event": "start",
                    # a local cluster without the dashboard still serves Dask's plain HTTP routes
                    "dashboard": getattr(client, "dashboard_link", None)
                    if scheduler is not None or cfg.cluster.local.dashboard
                    else None,
                    "roles": {n: members.role_of(w).value for n, w in members.workers.items()},
                }
            )
        if on_start is not None:
            on_start(ctl)
        ctl.window_start = time.time()
        ctl.loop(cancelled, retry)
        job.set_status("done")
        queue.wake(*members.workers)  # idle loops see the end now
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        redis_down = True
        raise redis_lost(url, retry, outage_s=s.redis_outage_s, exc=exc, out=out) from None
    except KeyboardInterrupt:  # Ctrl-C: stopped as a cancel is, without waiting on the task in hand
        interrupted = True
        if progress is not None:
            progress({"event": "interrupted"})  # the bar stops now, not after the shutdown
        job.set_status("cancelled")  # the loops drop their task and return
        queue.wake(*members.workers)
        raise
    except BaseException:
        if not redis_down:
            job.set_status("failed" if job.status() != "cancel" else "cancelled")
        raise
    finally:
        # the loops return within a task; on Ctrl-C closing the cluster ends any still busy
        returned, busy = await_loops(
            list(members.loops.values()),
            per_loop_s=1 if redis_down else LOOP_WAIT_S,
            total_s=INTERRUPT_WAIT_S if interrupted else math.inf,
        )
        if interrupted:  # how the job stopped: its loops answered the stop, or the deadline passed
            log.info(
                "interrupted: %d of %d worker loops returned, %d still busy after the %.1f s "
                "wait were ended with the cluster",
                returned,
                returned + busy,
                busy,
                INTERRUPT_WAIT_S,
            )
        if client is not None:
            client.close()
        if starting is not None:
            starting.close()
        if not redis_down:
            queue.clear()  # every key of the job (its blob key too), from an external Redis as well
        restore_sigterm()
    return run.write_summary(cfg.schedule.mode)


def await_loops(loops: list, per_loop_s: float, total_s: float) -> tuple[int, int]:
    """Wait for the worker loops' futures to finish: at most ``per_loop_s`` on each and
    ``total_s`` on all together (after a Ctrl-C, :data:`INTERRUPT_WAIT_S`: a loop that does not
    answer the stop is ended with the cluster, never waited on loop after loop). Returns how
    many finished (a loop that raised finished: its error was logged by it) and how many were
    still busy when their wait ran out."""
    deadline = time.monotonic() + total_s
    returned = busy = 0
    for fut in loops:
        try:
            fut.result(timeout=max(0.0, min(per_loop_s, deadline - time.monotonic())))
        except TimeoutError:
            busy += 1
            continue
        except Exception:  # noqa: BLE001 - a loop's error was already logged by it
            pass
        returned += 1
    return returned, busy


def _sigterm_stops(job_id: str, run: RunDir) -> Callable[[], None]:
    """While the controller runs (in the main thread), SIGTERM stops the job as ``digen
    cancel`` does: :class:`JobCancelled` is raised, so the cluster is closed and the job's keys
    are deleted from Redis (a bare SIGTERM would leave them all, its blob key among them, in an
    external Redis). A second SIGTERM, during that clean-up, ends the process at once.
    Returns the function that puts the previous handler back."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def stop(signum, frame) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        ckpt = run.latest_checkpoint()
        kept = f"the checkpoint {ckpt} is kept" if ckpt is not None else "no iteration had finished"
        raise JobCancelled(f"job {job_id} stopped by SIGTERM; {kept}: continue it with --resume")

    previous = signal.signal(signal.SIGTERM, stop)

    def restore() -> None:
        signal.signal(signal.SIGTERM, previous)

    return restore
