"""The job runner, ``digen serve``: an rq worker that runs the jobs ``digen submit`` queued.

rq keeps its queue and its worker apart; so does digen: :mod:`digen.service.jobs` is the
client side (submit, status, logs, cancel), this module the worker side. ``digen serve``
forks one work horse per job, which runs :func:`execute_job` (the reference loop or the
distributed controller) and reports its progress in the job's meta and log.

Lost jobs. A work horse that dies under a live runner is retried by rq at once. When the
whole runner dies (``kill -9`` of ``digen serve``, a lost host), rq itself would notice only
after the dead worker's started-registry entry expires (``job_monitoring_interval + 60`` =
90 s) *and* a live worker runs its maintenance, which an idle rq worker does only after its
blocking dequeue (``worker_ttl - 15`` s, 405 s by default). digen does not wait for either:
every job heartbeats (``digen:job:<id>:alive``, :data:`~digen.service.jobs.ALIVE_TTL_S`),
and every runner, idle (its dequeue is cut to :data:`DEQUEUE_S`), busy (each time rq checks
its work horse) or in ``--burst`` (before and while it waits for a job), calls
:func:`recover_lost_jobs` every :data:`MAINTENANCE_S` seconds. A started job whose heartbeat
has been gone for :data:`CONFIRM_S` seconds (measured on the Redis server's clock, from the
first runner that saw it gone) is re-queued with rq's retry (one of ``--retries``), or
failed when none is left. A lost job therefore runs again within :data:`RECOVERY_BOUND_S`
(40 s: the heartbeat expires, then two maintenance periods) of a runner being up. The
confirmation window covers a Redis restart, after which a live horse's heartbeat returns
within a second; the run directory's lock
(:class:`~digen.rundir.RunLock`) refuses a second copy of a run on the same host anyway.
When the retry starts, the keys the dead attempt's controller left in Redis
(``digen:<id>.<attempt>:*``) are deleted.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from rq import Worker
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from digen.config import Config, SecurityConfig, build_config
from digen.errors import ConfigError, DigenError, JobCancelled, JobRefused
from digen.iteration import progress_line
from digen.service.jobs import (
    ALIVE_TTL_S,
    HEARTBEAT_S,
    JOB_FUNC,
    JOB_KWARGS,
    MAX_JOB_BYTES,
    OLD_JOB_FUNCS,
    QUEUE_NAME,
    RUNNER_PREFIX,
    STARTING_GRACE_S,
    DigenJob,
    _text,
    alive_key,
    attempt_id,
    attempt_keys_pattern,
    info_key,
    job_queue,
    mark_runner,
    note_refused,
    push_log,
)

log = logging.getLogger(__name__)

CONFIRM_S = 10.0
"""Seconds a started job's heartbeat must stay gone (Redis server clock) before a runner
re-queues it."""
MAINTENANCE_S = 10
"""How often a runner looks for lost jobs (rq's ``maintenance_interval``)."""
DEQUEUE_S = 10
"""How long an idle runner blocks on the queue before its maintenance runs again."""
JOB_MONITORING_S = 10
"""How often a busy runner checks its work horse (and then looks for lost jobs)."""
RECOVERY_BOUND_S = max(ALIVE_TTL_S, STARTING_GRACE_S) + DEQUEUE_S + max(CONFIRM_S, DEQUEUE_S)
"""The most seconds from a runner's death to its job being queued again while another runner
is up: the heartbeat expires (a job that died before its first beat counts as starting for
STARTING_GRACE_S), the next maintenance sees it missing, a maintenance at least CONFIRM_S
later re-queues it; the runner that did so dequeues it at once."""
_WORKER_TTL_S = DEQUEUE_S + 15  # rq: dequeue timeout = worker_ttl - 15
PUBSUB_WAKE_S = 1.0
"""How often the runner's rq command thread wakes (the longest its exit waits for it)."""


# ---------------------------------------------------------------------------------------------
# lost jobs


def _server_time(r: redis.Redis) -> float:
    sec, usec = r.time()
    return float(sec) + float(usec) / 1e6


@dataclass(frozen=True)
class Recovery:
    """What :func:`recover_lost_jobs` did with one lost job."""

    job_id: str
    action: str
    """``requeued`` (a retry), ``failed`` (no retry left), ``cancelled``, ``resumed`` (the job
    was resumed as another one), or ``waiting`` (seen lost, within :data:`CONFIRM_S`)."""


def recover_lost_jobs(r: redis.Redis, by: str = "", *, now: float | None = None) -> list[Recovery]:
    """Re-queue the started jobs whose runner died (see the module docstring).

    ``now``: the Redis server's clock (default its ``TIME``; tests pass their own). A job
    counts as lost when rq calls it started, it was taken more than ``STARTING_GRACE_S`` ago
    and its heartbeat has been missing for :data:`CONFIRM_S` seconds, the first sighting
    being recorded in the job's hash (``lost_since``) so that every runner measures from the
    same instant. Only one runner acts on a job: the one whose ``ZREM`` of the job's
    started-registry entry succeeds."""
    from rq.registry import StartedJobRegistry

    now = _server_time(r) if now is None else now
    registry = StartedJobRegistry(QUEUE_NAME, connection=r, serializer=JSONSerializer)
    members: dict[str, list[bytes]] = {}
    for raw in r.zrange(registry.key, 0, -1):
        job_id = _text(raw).split(":", 1)[0]
        members.setdefault(job_id, []).append(raw)
    done: list[Recovery] = []
    for job_id, entries in members.items():
        if r.exists(alive_key(job_id)):
            r.hdel(info_key(job_id), "lost_since")
            continue
        try:
            job = DigenJob.fetch(job_id, connection=r, serializer=JSONSerializer)
        except Exception:  # noqa: BLE001 - expired, or not one of ours: rq's maintenance handles it
            continue
        if job.get_status(refresh=False) != JobStatus.STARTED:
            continue
        taken = job.started_at.timestamp() if job.started_at is not None else None
        if taken is not None and now - taken < STARTING_GRACE_S and job.meta.get("state") != "running":
            continue  # its work horse is starting: no heartbeat yet
        r.hsetnx(info_key(job_id), "lost_since", repr(now))
        try:
            since = float(_text(r.hget(info_key(job_id), "lost_since") or b""))
        except ValueError:
            since = now
        if now - since < CONFIRM_S:
            done.append(Recovery(job_id, "waiting"))
            continue
        if not r.zrem(registry.key, *entries):
            continue  # another runner took it
        done.append(Recovery(job_id, _requeue_lost(r, job, by, now - since)))
    return done


def _requeue_lost(r: redis.Redis, job: Job, by: str, gone_s: float) -> str:
    from rq.job_lifecycle import record_job_failure

    info: dict[Any, Any] = r.hgetall(info_key(job.id))
    r.hdel(info_key(job.id), "lost_since")
    dead = f"{job.meta.get('worker') or job.worker_name or 'its runner'} (pid {job.meta.get('pid', '?')} on {job.meta.get('host', '?')})"
    where = f" by {by}" if by else ""
    queue = job_queue(r)
    if info.get(b"resumed_by"):
        action, line = (
            "resumed",
            f"its runner {dead} died; not re-run: resumed as {_text(info[b'resumed_by'])}",
        )
    elif b"cancel" in info:
        action, line = (
            "cancelled",
            f"its runner {dead} died; cancelled, the run directory keeps the last checkpoint",
        )
    elif job.retries_left:
        with r.pipeline() as p:
            job.retry(queue, p)
            p.execute()
        job.meta.update({"state": "queued", "lost_at": time.time()})
        job.save_meta()
        push_log(
            r,
            job.id,
            f"lost: its runner {dead} died (no heartbeat for {gone_s:.0f} s); re-queued{where} "
            f"({job.retries_left} more retr{'y' if job.retries_left == 1 else 'ies'} left)",
        )
        log.warning("job %s was lost (runner %s died); re-queued%s", job.id, dead, where)
        return "requeued"
    else:
        action = "failed"
        line = f"its runner {dead} died and no retry is left; continue it with digen submit --resume {job.id}"
    with r.pipeline() as p:
        record_job_failure(job, f"JobLost: {line}", p)
        p.execute()
    _drop_attempt_keys(r, job.id)  # no attempt of it runs again: its blob key goes too
    if action != "resumed":
        _finish_meta(job, action, error=None if action == "cancelled" else f"JobLost: {line}")
    push_log(r, job.id, line)
    log.warning("job %s: %s", job.id, line)
    return action


def _lost_soon(r: redis.Redis, waited_s: float) -> bool:
    """Whether a started job may be lost: ``--burst`` waits for it to be confirmed. A job
    without heartbeat may be; so may any started job until a heartbeat of a runner that died
    just before this one started has had the time to expire (``waited_s``: how long it waited)."""
    from rq.registry import StartedJobRegistry

    registry = StartedJobRegistry(QUEUE_NAME, connection=r, serializer=JSONSerializer)
    for raw in r.zrange(registry.key, 0, -1):
        job_id = _text(raw).split(":", 1)[0]
        if waited_s >= ALIVE_TTL_S + 2 * HEARTBEAT_S and r.exists(alive_key(job_id)):
            continue  # beating: alive
        try:
            job = DigenJob.fetch(job_id, connection=r, serializer=JSONSerializer)
        except Exception:  # noqa: BLE001 - not a job recover_lost_jobs would act on
            continue
        if job.get_status(refresh=False) == JobStatus.STARTED:
            return True
    return False


def adopt_old_name(job: Job) -> None:
    """A job an older digen queued names the job function where that digen kept it
    (:data:`~digen.service.jobs.OLD_JOB_FUNCS`): it runs the same function at its new home."""
    if job.func_name in OLD_JOB_FUNCS:
        job.func_name = JOB_FUNC


_CALLBACKS = ("success", "failure", "stopped")
REFUSE_FUNC = "digen.service.runner.refuse_job"
"""What a refused job runs instead of what it named: it records the refusal and fails."""
_REFUSED_TIMEOUT_S = 60


def _shown(value: Any, limit: int = 120) -> str:
    """``value`` for a one-line message: printable, cut at ``limit`` characters."""
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    text = "".join(c if c.isprintable() else "?" for c in text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def refusal(job: Job) -> str | None:
    """Why ``digen serve`` refuses ``job`` (one line naming what it asked for), or None for
    digen's job: :data:`~digen.service.jobs.JOB_FUNC` (or an old name of it), no instance,
    no positional argument, keyword arguments of :data:`~digen.service.jobs.JOB_KWARGS`'s
    names and JSON types, no rq callback, no webhook. Reads only the job's JSON (rq's
    ``JSONSerializer``: a pickled payload does not parse and is refused as not JSON);
    nothing it names is imported."""
    from rq.exceptions import DeserializationError

    head = f"refused rq job {_shown(job.id, 64)}"
    if getattr(job, "oversized", None) is not None or len(job.data) > MAX_JOB_BYTES:
        return f"{head}: its payload unzips to more than digen's {MAX_JOB_BYTES} bytes; not read"
    try:
        func, instance, args, kwargs = job.func_name, job.instance, job.args, job.kwargs
    except DeserializationError:
        return f"{head}: its payload is not JSON (pickled?); digen serve runs only {JOB_FUNC}"
    if func in OLD_JOB_FUNCS:
        func = JOB_FUNC
    if func != JOB_FUNC or instance is not None:
        what = f"a method {_shown(func)} of {_shown(instance)}" if instance is not None else _shown(func)
        return f"{head}: it names {what}, not digen's job {JOB_FUNC}; not imported, not called"
    if args:
        return f"{head}: {JOB_FUNC} takes no positional argument, it has {_shown(args)}"
    if not isinstance(kwargs, dict):
        return f"{head}: its arguments are {type(kwargs).__name__}, not an object of {sorted(JOB_KWARGS)}"
    unknown = sorted(set(kwargs) - set(JOB_KWARGS))
    if unknown:
        return f"{head}: unknown argument(s) {_shown(unknown)} of {JOB_FUNC} (it takes {sorted(JOB_KWARGS)})"
    for name in ("config", "out"):
        if name not in kwargs:
            return f"{head}: argument {name} of {JOB_FUNC} is missing"
    for name, value in kwargs.items():
        if not isinstance(value, JOB_KWARGS[name]):
            want = " or ".join("null" if t is type(None) else t.__name__ for t in JOB_KWARGS[name])
            return f"{head}: argument {name} is {type(value).__name__}, not {want}"
    for kind in _CALLBACKS:
        name = getattr(job, f"_{kind}_callback_name", None)
        if name:
            return f"{head}: it asks rq to call {_shown(name)} on {kind}; digen's jobs have no callback"
    if getattr(job, "webhooks", None):
        return f"{head}: it asks for webhooks; digen's jobs have none"
    return None


def _disarm(job: Job, reason: str) -> None:
    """Make ``job`` run :func:`refuse_job` instead of what it named, with nothing of its own
    left for rq to import or call (callbacks, webhooks, an instance) and no retry."""
    for kind in _CALLBACKS:
        setattr(job, f"_{kind}_callback_name", None)
        setattr(job, f"_{kind}_callback", None)
    job.webhooks = []
    job.retries_left = 0
    job.timeout = _REFUSED_TIMEOUT_S
    job._func_name, job._instance, job._args = REFUSE_FUNC, None, ()  # noqa: SLF001 - rq's fields
    job._kwargs = {"reason": reason}  # noqa: SLF001


def refuse_job(reason: str) -> None:
    """What a refused job runs (:func:`_disarm`): record it failed (its meta, its log, the
    job index that ``digen status`` lists, the ``digen:refused`` count) and raise."""
    from rq import get_current_job

    job = get_current_job()
    if job is not None:
        job.meta = {"state": "failed", "error": reason, "ended": time.time(), "config": "-", "mode": "-"}
        job.save_meta()
        note_refused(job.connection, job.id, reason)
    log.warning("%s", reason)
    raise JobRefused(reason)


class DigenWorker(Worker):
    """rq's worker with digen's lost-job recovery in its maintenance, which runs every
    :data:`MAINTENANCE_S` seconds whether it is idle (its dequeue blocks :data:`DEQUEUE_S`)
    or busy (each check of its work horse). It runs digen's job alone (:func:`refusal`)."""

    def run_maintenance_tasks(self) -> None:
        super().run_maintenance_tasks()
        self._recover()

    def subscribe(self) -> None:
        """rq's command channel, its thread waking every :data:`PUBSUB_WAKE_S`: rq's 60 s
        made a runner's exit wait up to 60 s (redis-py's ``stop()`` joins the thread, which
        waits out its sleep once unsubscribed), so ``--burst`` took a minute to return."""
        self.pubsub = self.connection.pubsub()
        self.pubsub.subscribe(**{self.pubsub_channel_name: self.handle_payload})
        self.pubsub_thread = self.pubsub.run_in_thread(
            sleep_time=PUBSUB_WAKE_S, daemon=True, exception_handler=self._pubsub_exception_handler
        )

    def perform_job(self, job, queue, execution) -> bool:  # in the work horse
        reason = refusal(job)
        if reason is None:
            adopt_old_name(job)
        else:
            _disarm(job, reason)
        return super().perform_job(job, queue, execution)

    def handle_exception(self, job, *exc_info) -> None:  # in the work horse
        if len(exc_info) > 1 and isinstance(exc_info[1], JobRefused):
            return  # refuse_job logged its one line; rq would add a traceback of digen's own code
        super().handle_exception(job, *exc_info)

    def maintain_heartbeats(self, job, execution) -> None:  # busy: called every job_monitoring_interval
        super().maintain_heartbeats(job, execution)
        self._recover()

    def _recover(self) -> None:
        try:
            recover_lost_jobs(self.connection, by=self.name)
        except redis.RedisError as exc:  # a Redis blip: the next maintenance tries again
            log.warning("looking for lost jobs failed: %s", exc)


# ---------------------------------------------------------------------------------------------
# digen serve


@dataclass
class ServeContext:
    """What ``digen serve`` hands to the jobs it runs (inherited by the forked work horse)."""

    redis_url: str
    scheduler: str | None
    pid: int
    name: str
    security: SecurityConfig | None = None
    """``digen serve --security``: this node's TLS files, which the jobs' Dask client uses
    instead of their config's ``security:`` section."""


_SERVE: ServeContext | None = None


def serve(
    r: redis.Redis,
    redis_url: str,
    *,
    scheduler: str | None = None,
    burst: bool = False,
    burst_wait_s: float = 30.0,
    name: str | None = None,
    verbose: bool = False,
    security: SecurityConfig | None = None,
    insecure: bool = False,
) -> bool:
    """Run submitted jobs with an rq worker until stopped (SIGINT/SIGTERM: after the current
    job). ``burst``: wait up to ``burst_wait_s`` for a first job (longer while a started job
    has lost its heartbeat: it is re-queued once confirmed lost), run jobs until the queue is
    empty, return. Returns False when a burst found nothing to run. A plain ``tcp://``
    scheduler on another host needs ``insecure``; ``security``: this node's TLS files."""
    global _SERVE
    if scheduler is not None:
        from digen.cluster.node import check_reachable, check_scheduler_address

        check_scheduler_address(scheduler, insecure=insecure)
        check_reachable(scheduler, security=security)
    # unique even for a container restarted with the same host name and pid
    name = name or f"digen-serve-{socket.gethostname().split('.')[0]}-{os.getpid()}-{uuid.uuid4().hex[:4]}"
    _SERVE = ServeContext(
        redis_url=redis_url, scheduler=scheduler, pid=os.getpid(), name=name, security=security
    )
    queue = job_queue(r)
    mark_runner(r, name)  # digen submit sees a runner from now on (rq registers it in work())
    try:
        if burst:
            start = time.monotonic()
            while True:
                mark_runner(r, name)
                recover_lost_jobs(r, by=name)
                if queue.count:
                    break
                waited = time.monotonic() - start
                if waited >= burst_wait_s and (
                    waited >= burst_wait_s + RECOVERY_BOUND_S or not _lost_soon(r, waited)
                ):
                    return False
                time.sleep(0.5)
        worker = DigenWorker(
            [queue],
            connection=r,
            serializer=JSONSerializer,
            job_class=DigenJob,
            name=name,
            maintenance_interval=MAINTENANCE_S,
            worker_ttl=_WORKER_TTL_S,
            job_monitoring_interval=JOB_MONITORING_S,
        )
        try:
            worker.work(burst=burst, logging_level="INFO" if verbose else "WARNING")
        except ValueError as exc:
            if "active worker" not in str(exc):
                raise
            raise ConfigError(
                f"a digen serve named {name} is already registered (running, or died less than "
                f"{worker.worker_ttl + 60} s ago); choose another --name or drop it"
            ) from None
        return True
    finally:
        with contextlib.suppress(redis.RedisError):  # a runner that stops says so at once
            r.delete(RUNNER_PREFIX + name)


# ---------------------------------------------------------------------------------------------
# the job function


def execute_job(config: dict, source_dir: str | None, out: str, resume: bool = False) -> dict:
    """The rq job function (run by ``digen serve``): train ``config`` into ``out``.

    A retried job (``attempts`` > 1) and a ``resume`` job continue from the run directory's
    newest checkpoint; with none there, they start over. Bad input (a config the worker
    cannot load, a missing model folder) and cancellation are not retried.
    """
    from rq import get_current_job

    job = get_current_job()
    if job is None:
        raise DigenError("execute_job runs inside an rq worker: start one with digen serve")
    r: redis.Redis = job.connection
    ctx = _SERVE
    if ctx is not None:
        _die_with_parent(ctx.pid)
    jid = job.id
    attempt = int(r.hincrby(info_key(jid), "attempts", 1))
    r.hdel(info_key(jid), "lost_since")
    info: dict[Any, Any] = r.hgetall(info_key(jid))
    if info.get(b"resumed_by"):
        job.retries_left = 0
        push_log(r, jid, f"not run: resumed as job {_text(info[b'resumed_by'])}")
        return {"resumed_by": _text(info[b"resumed_by"])}
    if b"cancel" in info:
        _finish_meta(job, "cancelled")
        job.retries_left = 0
        push_log(r, jid, "not run: cancelled")
        raise JobCancelled(f"job {jid} was cancelled before it ran")

    beat = _Heartbeat(r, jid, {"pid": os.getpid(), "host": socket.gethostname()})
    beat.start()
    try:
        dropped = _drop_attempt_keys(r, jid)
        if dropped:
            push_log(r, jid, f"deleted {dropped} Redis keys an earlier attempt left behind")
        return _run(job, r, ctx, config, source_dir, Path(out), resume or attempt > 1, attempt)
    except BaseException as exc:
        cancelled = r.hexists(info_key(jid), "cancel")
        retry = (
            not cancelled
            and isinstance(exc, Exception)
            and not isinstance(exc, ConfigError)
            and bool(job.retries_left)
        )
        if not retry:
            job.retries_left = 0
        state = "cancelled" if cancelled else ("retrying" if retry else "failed")
        reason = (str(exc) if isinstance(exc, DigenError) else f"{type(exc).__name__}: {exc}").strip()
        reason = (reason.splitlines() or [type(exc).__name__])[0][:500]
        _note_quarantined(r, job, attempt)
        _finish_meta(job, state, error=None if cancelled else reason)
        push_log(
            r,
            jid,
            "cancelled; the run directory keeps the last checkpoint"
            if cancelled
            else f"{'failed (will retry)' if retry else 'failed'}: {reason}",
        )
        raise
    finally:
        beat.stop()


def _drop_attempt_keys(r: redis.Redis, job_id: str) -> int:
    """Delete every earlier attempt's controller keys (``digen:<id>.<n>:*``)."""
    n, batch = 0, []
    for key in r.scan_iter(match=attempt_keys_pattern(job_id), count=1000):
        batch.append(key)
        if len(batch) >= 1000:
            n += int(r.unlink(*batch))
            batch = []
    if batch:
        n += int(r.unlink(*batch))
    return n


def _note_quarantined(r: redis.Redis, job: Job, attempt: int) -> None:
    """Copy the count of junk the attempt's queue quarantined into the job's meta."""
    from digen.controlplane.queue import quarantined_count

    try:
        n = quarantined_count(r, attempt_id(job.id, attempt))
    except redis.RedisError:
        return
    if n and n != job.meta.get("quarantined"):
        job.meta["quarantined"] = n
        job.save_meta()


def _run(
    job: Job,
    r: redis.Redis,
    ctx: ServeContext | None,
    config: dict,
    source_dir: str | None,
    out: Path,
    want_resume: bool,
    attempt: int,
) -> dict:
    from digen.checks import check_inputs
    from digen.engine import run_training
    from digen.rundir import RunLock

    # train.algorithm is checked by check_inputs below (the registry imports torch: for the
    # distributed modes in a child process, this one being their controller)
    cfg = build_config(config, source_dir=Path(source_dir) if source_dir else None, algorithms=False)
    jid = job.id
    if cfg.schedule.mode != "reference" and ctx is None:
        raise ConfigError(
            f"schedule.mode {cfg.schedule.mode} jobs run under digen serve (not a bare rq worker)"
        )
    scheduler = ctx.scheduler if ctx else None
    if ctx is not None and ctx.security is not None:  # the node's own files over the job's
        cfg = cfg.model_copy(update={"security": ctx.security})
    if scheduler and scheduler.startswith("tls://") and not cfg.security.enabled:
        raise ConfigError(
            f"the Dask scheduler {scheduler} uses TLS: give the job config a security: section "
            f"(ca_file, cert_file, key_file; see docs/deploy.md)"
        )
    check_inputs(cfg, out, resume=want_resume and _has_checkpoint(out), health=True)
    with RunLock(out):  # before anything in the run directory changes
        resume, done = _prepare_run_dir(cfg, out, want_resume)
        job.meta.update(
            {
                "state": "running",
                "iteration": done,
                "total": cfg.iterations,
                "run_dir": str(out),
                "started": time.time(),
                "attempt": attempt,
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "worker": ctx.name if ctx else job.worker_name,
                "mode": cfg.schedule.mode,
                "error": None,
            }
        )
        job.save_meta()
        where = f"serve {ctx.name}" if ctx else "an rq worker"
        how = f"resuming after iteration {done}" if resume else "starting"
        push_log(r, jid, f"{how} on {where} (attempt {attempt}), run directory {out}")

        def progress(m: dict) -> None:
            if "event" in m or "iteration" not in m:
                push_log(r, jid, _event_line(m))
                return
            k = int(m["iteration"]) + 1
            job.meta.update(
                {
                    "iteration": k,
                    "reward": m.get("reward_mean"),
                    "samples_per_s": m.get("samples_per_s"),
                    "updated": time.time(),
                }
            )
            _note_quarantined(r, job, attempt)
            job.save_meta()
            push_log(r, jid, progress_line(m, cfg.iterations))

        with _job_logging(r, jid), _dask_tls(cfg if scheduler else None):
            summary = run_training(
                cfg,
                out,
                resume=resume,
                redis_url=ctx.redis_url if ctx else None,
                scheduler=scheduler,
                progress=progress,
                cancelled=lambda: bool(r.hexists(info_key(jid), "cancel")),  # digen cancel
                job_id=attempt_id(jid, attempt),
                checked=True,
            )
    _note_quarantined(r, job, attempt)
    _finish_meta(job, "done")
    push_log(
        r,
        jid,
        f"done: {summary['iterations']} iterations, {summary['samples']} samples, "
        f"{summary['samples_per_s']:.2f} samples/s, reward {summary['reward_first']:.4f} -> "
        f"{summary['reward_last']:.4f}",
    )
    return summary


def _has_checkpoint(out: Path) -> bool:
    from digen.rundir import latest_intact_checkpoint

    return latest_intact_checkpoint(out) is not None


def _event_line(m: dict) -> str:
    """A log line for an announcement of the run (``{"event": "start", "roles": ..., ...}``)."""
    if m.get("event") == "start" and isinstance(m.get("roles"), dict):
        workers = ", ".join(f"{w} [{role}]" for w, role in sorted(m["roles"].items()))
        dash = f"; dashboard {m['dashboard']}" if m.get("dashboard") else ""
        return f"cluster up: {len(m['roles'])} workers: {workers}{dash}"
    return " ".join(f"{k}={v}" for k, v in m.items())


def _prepare_run_dir(cfg: Config, out: Path, want_resume: bool) -> tuple[bool, int]:
    """(resume?, iterations already done). Without a checkpoint, rows an earlier attempt
    wrote are dropped and the run starts over."""
    if not want_resume:
        return False, 0
    from digen.rundir import RunDir

    run = RunDir(out, cfg, resume=True)
    ckpt = run.latest_checkpoint()
    if ckpt is not None:
        state = json.loads((ckpt / "state.json").read_text())
        return True, int(state.get("iteration", int(ckpt.name.split("_")[-1]))) + 1
    for name in ("metrics.jsonl", "timeline.jsonl", "summary.json"):
        (out / name).unlink(missing_ok=True)
    return False, 0


def _finish_meta(job: Job, state: str, error: str | None = None) -> None:
    job.meta.update({"state": state, "ended": time.time()})
    if error is not None:
        job.meta["error"] = error
    job.save_meta()


class _Heartbeat:
    """Keeps ``digen:job:<id>:alive`` set while the job's process lives."""

    def __init__(self, r: redis.Redis, job_id: str, payload: dict):
        self.r, self.key, self.payload = r, alive_key(job_id), json.dumps(payload)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"digen-heartbeat-{job_id}", daemon=True)

    def beat(self) -> None:
        self.r.set(self.key, self.payload, px=int(ALIVE_TTL_S * 1000))

    def start(self) -> None:
        self.beat()
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self.beat()
            except redis.RedisError as exc:  # a blip: the next beat may work
                log.warning("heartbeat failed: %s", exc)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            self.r.delete(self.key)
        except redis.RedisError:
            pass


class _RedisLogHandler(logging.Handler):
    def __init__(self, r: redis.Redis, job_id: str):
        super().__init__(logging.INFO)
        self.r, self.job_id = r, job_id
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            push_log(self.r, self.job_id, self.format(record))
        except Exception:  # noqa: BLE001 - logging must never break the job
            self.handleError(record)


@contextmanager
def _job_logging(r: redis.Redis, job_id: str) -> Iterator[None]:
    """digen's and the workers' log records (INFO and up) also go to the job's log."""
    handler = _RedisLogHandler(r, job_id)
    loggers = [logging.getLogger("digen")]  # digen.workers.* included
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        if lg.getEffectiveLevel() > logging.INFO:
            lg.setLevel(logging.INFO)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.removeHandler(handler)
            lg.setLevel(level)


@contextmanager
def _dask_tls(cfg: Config | None) -> Iterator[None]:
    """The config's ``security:`` section as dask's TLS settings for the controller's client."""
    from digen.cluster.node import dask_tls_config

    settings = dask_tls_config(cfg.security) if cfg is not None else {}
    if not settings:
        yield
        return
    import dask
    import distributed  # noqa: F401 - load its config defaults first, or leaving set() would drop them

    with dask.config.set(settings):
        yield


def _die_with_parent(parent_pid: int) -> None:
    """In a work horse forked by ``digen serve``: die when serve dies (Linux), so a killed
    serve leaves no orphan job behind and the job becomes resumable."""
    if os.getpid() == parent_pid or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        return
    if os.getppid() != parent_pid:  # serve died before prctl took effect
        os._exit(1)
