"""The job service: training jobs queued in rq and run by ``digen serve``.

``submit`` validates a config, then enqueues :func:`execute_job` by its import path with
JSON-only arguments (rq's ``JSONSerializer``: nothing in Redis is pickled). ``digen serve``
is an rq worker: it forks one work horse per job, which runs the job (the reference loop or
the distributed controller) and reports its progress. ``status``, ``logs`` and ``cancel``
read and steer jobs from any process, on any machine that reaches the Redis.

Keys besides rq's own (``rq:job:<id>``, ``rq:queue:digen:jobs`` and its registries)::

    digen:job-index        zset    job id -> submit time (what ``digen status`` lists)
    digen:job:<id>         hash    attempts, cancel, resumed_from, resumed_by, log_total
    digen:job:<id>:log     list    log lines (the newest LOG_MAX)
    digen:job:<id>:alive   string  heartbeat of the process running the job (expires in ALIVE_TTL_S)

Progress (``state``, ``iteration`` done, ``total``, ``reward``, ``samples_per_s``,
``run_dir``...) lives in the rq job's ``meta``. The controller's own keys (``digen:<id>:*``)
are deleted when a run ends, hence the separate ``digen:job:`` namespace.

A job's *state* (:data:`STATES`) combines rq's status with the heartbeat: a job rq still
calls started whose heartbeat expired is ``lost`` (its runner died). It is resumable:
``digen submit --resume ID`` enqueues a new job on the same run directory, or rq retries it
(``--retries``: at once when the work horse crashed, within about two minutes when the whole
``digen serve`` died and another one does its maintenance). Every (re)start continues from
the run directory's newest checkpoint, so no iteration is repeated or lost.

Cancelling stops a running job at the next iteration boundary, after that iteration's
checkpoint (the progress callback raises), keeping the run directory.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import redis
from rq import Queue
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from digen.config import Config, build_config
from digen.errors import ConfigError, DigenError, JobCancelled

log = logging.getLogger(__name__)

QUEUE_NAME = "digen:jobs"
JOB_FUNC = "digen.runtime.service.execute_job"
INDEX_KEY = "digen:job-index"
DEFAULT_TIMEOUT_S = 7 * 24 * 3600  # training runs for hours or days; rq's default is 3 minutes
DEFAULT_RETRIES = 2
KEEP_S = 30 * 24 * 3600  # finished and failed jobs stay listed this long
ALIVE_TTL_S = 5.0
HEARTBEAT_S = 1.0
LOG_MAX = 20_000
STARTING_GRACE_S = 20.0  # rq says started but the job has not beaten yet: still starting

STATES = ("queued", "starting", "running", "cancelling", "done", "failed", "cancelled", "lost", "resumed")
TERMINAL = frozenset({"done", "failed", "cancelled", "resumed"})
TIMING_KEYS = frozenset({"wall_s", "samples_per_s", "busy_s", "worker_s", "bubble_ratio"})


class UnknownJob(ConfigError):
    """A job id that Redis does not know (never submitted, or expired)."""


# ---------------------------------------------------------------------------------------------
# keys


def info_key(job_id: str) -> str:
    return f"digen:job:{job_id}"


def log_key(job_id: str) -> str:
    return f"digen:job:{job_id}:log"


def alive_key(job_id: str) -> str:
    return f"digen:job:{job_id}:alive"


def job_queue(r: redis.Redis) -> Queue:
    return Queue(QUEUE_NAME, connection=r, serializer=JSONSerializer)


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def new_job_id() -> str:
    return uuid.uuid4().hex[:12]


def parse_duration(text: str) -> int:
    """``"90"``, ``"45m"``, ``"12h"``, ``"7d"`` -> seconds."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    raw = text.strip().lower()
    num, unit = (raw[:-1], raw[-1]) if raw and raw[-1] in units else (raw, "s")
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ConfigError(f"--timeout ({text}) must be a positive duration such as 3600, 90m, 12h or 7d")
    return int(value * units[unit])


def push_log(r: redis.Redis, job_id: str, line: str) -> None:
    """Append one line to the job's log (``digen logs``), keeping the newest LOG_MAX."""
    stamped = f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}"
    with r.pipeline() as p:
        p.rpush(log_key(job_id), stamped)
        p.ltrim(log_key(job_id), -LOG_MAX, -1)
        p.hincrby(info_key(job_id), "log_total", 1)
        p.expire(log_key(job_id), KEEP_S)
        p.execute()


def read_log(r: redis.Redis, job_id: str, start: int = 0) -> tuple[list[str], int]:
    """Lines number ``start`` onwards (counting every line ever written) and the next start."""
    with r.pipeline(transaction=True) as p:
        p.hget(info_key(job_id), "log_total")
        p.llen(log_key(job_id))
        total_raw, length = p.execute()
    total = int(total_raw or 0)
    first = total - int(length)  # number of the oldest line still kept
    start = max(start, first)
    if start >= total:
        return [], total
    lines = r.lrange(log_key(job_id), start - first, total - first - 1)
    return [_text(b) for b in lines], start + len(lines)


# ---------------------------------------------------------------------------------------------
# submit, resume, cancel


def job_args(cfg: Config, out: Path, resume: bool = False) -> dict[str, Any]:
    """The JSON arguments of :func:`execute_job`: the config with absolute paths (the worker's
    current directory is not the submitter's), its folder, the run directory."""
    update: dict[str, Any] = {}
    model_dir = cfg.resolve_path(cfg.model.path)
    if model_dir.exists():
        update["model"] = cfg.model.model_copy(update={"path": str(model_dir.resolve())})
    if cfg.prompts.file is not None and cfg.resolve_path(cfg.prompts.file).exists():
        update["prompts"] = cfg.prompts.model_copy(
            update={"file": str(cfg.resolve_path(cfg.prompts.file).resolve())}
        )
    if cfg.security.enabled:
        sec = cfg.security
        update["security"] = sec.model_copy(
            update={
                name: str(cfg.resolve_path(getattr(sec, name)).resolve())
                for name in ("ca_file", "cert_file", "key_file")
                if getattr(sec, name) and cfg.resolve_path(getattr(sec, name)).exists()
            }
        )
    data = cfg.model_copy(update=update).model_dump(mode="json")
    return {"config": data, "source_dir": cfg.source_dir, "out": str(Path(out).resolve()), "resume": resume}


def _run_has_rows(out: Path) -> bool:
    metrics = out / "metrics.jsonl"
    return metrics.exists() and any(line.strip() for line in metrics.read_text().splitlines())


def submit(
    r: redis.Redis,
    cfg: Config,
    out: Path,
    *,
    job_id: str | None = None,
    retries: int = DEFAULT_RETRIES,
    timeout_s: int = DEFAULT_TIMEOUT_S,
    config_name: str = "",
) -> str:
    """Enqueue a validated config; returns the job id. Refuses a run directory that already
    holds a run (resume that run's job instead)."""
    out = Path(out)
    if _run_has_rows(out):
        raise ConfigError(
            f"run directory {out} already holds a run; resume its job with "
            f"digen submit --resume JOB, or choose another --out"
        )
    return _enqueue(
        r,
        job_args(cfg, out),
        job_id=job_id or new_job_id(),
        retries=retries,
        timeout_s=timeout_s,
        meta={"config": config_name or "config", "mode": cfg.schedule.mode, "total": cfg.iterations},
    )


def resume(
    r: redis.Redis, job_id: str, *, retries: int = DEFAULT_RETRIES, timeout_s: int = DEFAULT_TIMEOUT_S
) -> str:
    """Enqueue a new job that continues ``job_id``'s run directory from its newest checkpoint."""
    info = job_info(r, job_id)
    if info.state in ("queued", "starting", "running", "cancelling"):
        raise ConfigError(
            f"job {job_id} is {info.state}: only a stopped job can be resumed; "
            f"digen cancel {job_id} first, or wait for it"
        )
    if info.state == "resumed":
        raise ConfigError(
            f"job {job_id} was already resumed as {info.resumed_by}; digen submit --resume {info.resumed_by}"
        )
    if info.state == "done":
        raise ConfigError(f"job {job_id} finished all {info.total} iterations: nothing to resume")
    old = _fetch(r, job_id)
    args = dict(old.kwargs)
    args["resume"] = True
    meta = {k: old.meta.get(k) for k in ("config", "mode", "total")}
    meta["resumed_from"] = job_id
    new_id = _enqueue(r, args, job_id=new_job_id(), retries=retries, timeout_s=timeout_s, meta=meta)
    r.hset(info_key(job_id), "resumed_by", new_id)
    r.hset(info_key(new_id), "resumed_from", job_id)
    push_log(r, job_id, f"resumed as job {new_id}")
    return new_id


def _enqueue(r: redis.Redis, args: dict, *, job_id: str, retries: int, timeout_s: int, meta: dict) -> str:
    from rq import Retry

    if retries < 0:
        raise ConfigError(f"--retries ({retries}) must be 0 or more")
    meta = {**meta, "state": "queued", "iteration": 0, "run_dir": args["out"], "submitted": time.time()}
    job_queue(r).enqueue_call(
        JOB_FUNC,
        kwargs=args,
        job_id=job_id,
        timeout=timeout_s,
        result_ttl=KEEP_S,
        failure_ttl=KEEP_S,
        description=f"digen {meta.get('config')} ({meta.get('mode')}, {meta.get('total')} iterations)",
        meta=meta,
        retry=Retry(max=retries) if retries > 0 else None,
    )
    with r.pipeline() as p:
        p.zadd(INDEX_KEY, {job_id: time.time()})
        p.hset(info_key(job_id), mapping={"attempts": 0})
        p.expire(info_key(job_id), KEEP_S)
        p.execute()
    push_log(
        r,
        job_id,
        f"submitted: {meta.get('config')} ({meta.get('mode')}, {meta.get('total')} iterations), "
        f"run directory {args['out']}{' (resume)' if args.get('resume') else ''}",
    )
    return job_id


def cancel(r: redis.Redis, job_id: str) -> str:
    """Stop ``job_id``: a queued job is dropped; a running one stops within one task (its
    controller stops releasing, the workers drop their task at the next denoising step or
    task boundary), keeping the last complete iteration's checkpoint. Returns the state the
    request was made in."""
    info = job_info(r, job_id)
    if info.state in TERMINAL:
        raise ConfigError(f"job {job_id} is already {info.state}; nothing to cancel")
    r.hset(info_key(job_id), "cancel", str(time.time()))
    if info.state == "queued":
        job = _fetch(r, job_id)
        job.cancel()
        job.meta["state"] = "cancelled"
        job.save_meta()
        push_log(r, job_id, "cancelled before it started")
    elif info.state == "lost":
        push_log(r, job_id, "cancelled (its runner had died); the run directory keeps the last checkpoint")
    else:
        push_log(r, job_id, "cancel requested: stopping within one task, keeping the last checkpoint")
    return info.state


# ---------------------------------------------------------------------------------------------
# status


@dataclass
class JobInfo:
    """What ``digen status`` shows about one job."""

    id: str
    state: str
    iteration: int
    total: int
    reward: float | None
    samples_per_s: float | None
    submitted: float | None
    started: float | None
    ended: float | None
    run_dir: str
    config: str
    mode: str
    worker: str | None
    attempts: int
    retries_left: int
    error: str | None
    resumed_from: str | None
    resumed_by: str | None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _fetch(r: redis.Redis, job_id: str) -> Job:
    from rq.exceptions import NoSuchJobError

    try:
        return Job.fetch(job_id, connection=r, serializer=JSONSerializer)
    except NoSuchJobError:
        raise UnknownJob(f"no job {job_id} in this Redis; digen status lists the jobs it knows") from None


def _ts(value: Any) -> float | None:
    return value.timestamp() if hasattr(value, "timestamp") else None


def _derive_state(
    status: JobStatus | None, meta: dict, info: dict[bytes, bytes], alive: bool, taken: float | None
) -> str:
    """The job's state from rq's status, the runner's heartbeat and meta; ``taken``: when an
    rq worker took the job (a runner that has not written its meta yet is ``starting``)."""
    cancel = b"cancel" in info
    if info.get(b"resumed_by") and not alive:
        return "resumed"
    if status in (
        JobStatus.QUEUED,
        JobStatus.DEFERRED,
        JobStatus.SCHEDULED,
        JobStatus.CREATED,
        JobStatus.RATE_LIMITED,
        JobStatus.READY_TO_ENQUEUE,
    ):
        return "queued"
    if status == JobStatus.STARTED:
        if alive:
            return "cancelling" if cancel else "running"
        if meta.get("state") != "running" and (taken is None or time.time() - taken < STARTING_GRACE_S):
            return "starting"
        return "cancelled" if cancel else "lost"
    if status == JobStatus.FINISHED:
        return "cancelled" if meta.get("state") == "cancelled" else "done"
    if status in (JobStatus.CANCELED, JobStatus.STOPPED):
        return "cancelled"
    if status == JobStatus.FAILED:
        return "cancelled" if cancel else "failed"
    return "failed"


def _info_from(job: Job, info: dict[bytes, bytes], alive: bool) -> JobInfo:
    meta = job.meta or {}
    status = job.get_status(refresh=False)
    started = meta.get("started") or _ts(job.started_at)
    error = meta.get("error")
    if status == JobStatus.FAILED and not error:
        result = job.latest_result()
        error = (result.exc_string or "").strip().splitlines()[-1:] if result is not None else None
        error = error[0] if error else None
    return JobInfo(
        id=job.id,
        state=_derive_state(status, meta, info, alive, _ts(job.started_at)),
        iteration=int(meta.get("iteration") or 0),
        total=int(meta.get("total") or 0),
        reward=meta.get("reward"),
        samples_per_s=meta.get("samples_per_s"),
        submitted=meta.get("submitted"),
        started=started,
        ended=meta.get("ended") or _ts(job.ended_at),
        run_dir=str(meta.get("run_dir") or ""),
        config=str(meta.get("config") or ""),
        mode=str(meta.get("mode") or ""),
        worker=meta.get("worker"),
        attempts=int(info.get(b"attempts") or 0),
        retries_left=int(job.retries_left or 0),
        error=error,
        resumed_from=(info.get(b"resumed_from") or b"").decode() or None,
        resumed_by=(info.get(b"resumed_by") or b"").decode() or None,
    )


def job_info(r: redis.Redis, job_id: str) -> JobInfo:
    job = _fetch(r, job_id)
    info: dict[Any, Any] = r.hgetall(info_key(job_id))
    return _info_from(job, info, bool(r.exists(alive_key(job_id))))


def list_jobs(r: redis.Redis, limit: int = 20) -> list[JobInfo]:
    """The newest ``limit`` jobs (0: all), newest first. Jobs whose rq record expired are
    dropped from the index."""
    ids = [_text(b) for b in r.zrevrange(INDEX_KEY, 0, limit - 1 if limit > 0 else -1)]
    if not ids:
        return []
    jobs = Job.fetch_many(ids, connection=r, serializer=JSONSerializer)
    with r.pipeline() as p:
        for job_id in ids:
            p.hgetall(info_key(job_id))
            p.exists(alive_key(job_id))
        raw = p.execute()
    out, gone = [], []
    for i, (job_id, job) in enumerate(zip(ids, jobs, strict=True)):
        if job is None:
            gone.append(job_id)
            continue
        out.append(_info_from(job, raw[2 * i], bool(raw[2 * i + 1])))
    if gone:
        r.zrem(INDEX_KEY, *gone)
    return out


def follow(
    r: redis.Redis,
    job_id: str,
    emit: Callable[[str], None],
    *,
    poll_s: float = 0.5,
    timeout_s: float | None = None,
) -> JobInfo:
    """Emit the job's log lines as they come until it reaches a terminal state (or a lost
    job has no retries left); returns its final :class:`JobInfo`."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    n = 0
    while True:
        lines, n = read_log(r, job_id, n)
        for line in lines:
            emit(line)
        info = job_info(r, job_id)
        if info.state in TERMINAL or (info.state == "lost" and info.retries_left == 0):
            lines, n = read_log(r, job_id, n)
            for line in lines:
                emit(line)
            return info
        if deadline is not None and time.monotonic() > deadline:
            return info
        time.sleep(poll_s)


# ---------------------------------------------------------------------------------------------
# running jobs: digen serve and the job function


@dataclass
class ServeContext:
    """What ``digen serve`` hands to the jobs it runs (inherited by the forked work horse)."""

    redis_url: str
    scheduler: str | None
    pid: int
    name: str


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
) -> bool:
    """Run submitted jobs with an rq worker until stopped (SIGINT/SIGTERM: after the current
    job). ``burst``: wait up to ``burst_wait_s`` for a first job, run jobs until the queue is
    empty, return. Returns False when a burst found nothing to run."""
    from rq import Worker

    global _SERVE
    if scheduler is not None:
        from digen.runtime.node import check_reachable

        check_reachable(scheduler)
    # unique even for a container restarted with the same host name and pid
    name = name or f"digen-serve-{socket.gethostname().split('.')[0]}-{os.getpid()}-{uuid.uuid4().hex[:4]}"
    _SERVE = ServeContext(redis_url=redis_url, scheduler=scheduler, pid=os.getpid(), name=name)
    queue = job_queue(r)
    if burst:
        deadline = time.monotonic() + burst_wait_s
        while queue.count == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        if queue.count == 0:
            return False
    worker = Worker([queue], connection=r, serializer=JSONSerializer, name=name, maintenance_interval=60)
    try:
        worker.work(burst=burst, logging_level="INFO" if verbose else "WARNING")
    except ValueError as exc:
        if "active worker" not in str(exc):
            raise
        raise ConfigError(
            f"a digen serve named {name} is already registered (running, or died less than "
            f"{worker.worker_ttl // 60} minutes ago); choose another --name or drop it"
        ) from None
    return True


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
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
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
    from digen.engine import run_training

    cfg = build_config(config, source_dir=Path(source_dir) if source_dir else None)
    jid = job.id
    if cfg.schedule.mode != "reference" and ctx is None:
        raise ConfigError(
            f"schedule.mode {cfg.schedule.mode} jobs run under digen serve (not a bare rq worker)"
        )
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
        job.save_meta()
        push_log(
            r,
            jid,
            f"iteration {k}/{cfg.iterations}  reward {m.get('reward_mean', float('nan')):.4f} "
            f"± {m.get('reward_std', float('nan')):.4f}  loss {m.get('loss', float('nan')):.3g}  "
            f"{m.get('samples_per_s', 0.0):.1f} samples/s  bubble {m.get('bubble_ratio', 0.0):.2f}",
        )

    scheduler = ctx.scheduler if ctx else None
    if scheduler and scheduler.startswith("tls://") and not cfg.security.enabled:
        raise ConfigError(
            f"the Dask scheduler {scheduler} uses TLS: give the job config a security: section "
            f"(ca_file, cert_file, key_file; see docs/deploy.md)"
        )
    with _job_logging(r, jid), _dask_tls(cfg if scheduler else None):
        summary = run_training(
            cfg,
            out,
            resume=resume,
            redis_url=ctx.redis_url if ctx else None,
            scheduler=scheduler,
            progress=progress,
            cancelled=lambda: bool(r.hexists(info_key(jid), "cancel")),  # digen cancel
        )
    _finish_meta(job, "done")
    push_log(
        r,
        jid,
        f"done: {summary['iterations']} iterations, {summary['samples']} samples, "
        f"{summary['samples_per_s']:.2f} samples/s, reward {summary['reward_first']:.4f} -> "
        f"{summary['reward_last']:.4f}",
    )
    return summary


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
    loggers = [logging.getLogger(name) for name in ("digen", "workers")]
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
    from digen.runtime.node import dask_tls_config

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
