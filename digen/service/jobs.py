"""The job service's client side: what ``digen submit``, ``status``, ``logs`` and ``cancel`` do.

``submit`` validates a config, then enqueues :func:`digen.service.runner.execute_job` by its
import path with JSON-only arguments (rq's ``JSONSerializer``: nothing in Redis is pickled).
The job runner, ``digen serve`` (:mod:`digen.service.runner`), is an rq worker that takes the
jobs and runs them, as rq keeps its queue and its worker apart. ``status``, ``logs`` and
``cancel`` read and steer jobs from any process, on any machine that reaches the Redis.

Keys besides rq's own (``rq:job:<id>``, ``rq:queue:digen:jobs`` and its registries)::

    digen:job-index        zset    job id -> submit time (what ``digen status`` lists)
    digen:job:<id>         hash    attempts, cancel, resumed_from, resumed_by, log_total,
                                   lost_since (when a runner first saw the job lost)
    digen:job:<id>:log     list    log lines (the newest LOG_MAX)
    digen:job:<id>:alive   string  heartbeat of the process running the job (expires in ALIVE_TTL_S)
    digen:runner:<name>    string  a ``digen serve`` starting or waiting for a first ``--burst``
                                   job, before rq registers it (expires in RUNNER_TTL_S)
    digen:refused          hash    count: rq jobs a runner refused (not digen's job); last: the
                                   newest refusal's line

Only digen's job runs. ``digen serve`` takes every rq job of its queue, but before anything
of it is imported or called it checks that the job names :data:`JOB_FUNC` with JSON keyword
arguments of :func:`job_args`'s shape (a config, its folder, the run directory, ``resume``)
and no rq callback or webhook (:func:`refusal`). Anything else (``os.system``, a pickled
payload, a method of some object) is recorded as a failed job whose error is one line naming
what it asked for, listed by ``digen status`` and counted in ``digen:refused``: the queue
may be reached by whoever holds the Redis password, which is not the right to run code as
the runner's user.

``submit`` warns when no runner is up (:func:`live_runners`: rq's registered workers of the
queue, whose registration expires when a runner dies, and the ``digen:runner:*`` keys).

Progress (``state``, ``iteration`` done, ``total``, ``reward``, ``samples_per_s``,
``run_dir``, ``quarantined``...) lives in the rq job's ``meta``. Each attempt's controller
keeps its own keys under ``digen:<id>.<attempt>:*`` (:func:`attempt_id`), deleted when the
attempt ends and, for an attempt whose runner died, when the next attempt starts.

A job's *state* (:data:`STATES`) combines rq's status with the heartbeat: a job rq still
calls started whose heartbeat expired is ``lost`` (its runner died). Any running ``digen
serve``, idle or busy, with or without ``--burst``, re-queues a lost job that has retries
left (``--retries``) within :data:`~digen.service.runner.RECOVERY_BOUND_S` seconds of being
up (:func:`digen.service.runner.recover_lost_jobs`); a work horse that crashes under a live
runner is retried by rq at once. ``digen submit --resume ID`` enqueues a new job on the same
run directory. Every (re)start continues from the run directory's newest checkpoint, so no
iteration is repeated or lost.

Cancelling stops a running job within one task, keeping the last checkpoint.
"""

from __future__ import annotations

import logging
import time
import uuid
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import redis
from rq import Queue
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from digen.config import Config
from digen.errors import ConfigError

log = logging.getLogger(__name__)

QUEUE_NAME = "digen:jobs"
JOB_FUNC = "digen.service.runner.execute_job"
OLD_JOB_FUNCS = frozenset({"digen.runtime.runner.execute_job", "digen.runtime.service.execute_job"})
"""Where older digens named the job function: a job they queued still runs
(:meth:`~digen.service.runner.DigenWorker.perform_job` renames it to :data:`JOB_FUNC`)."""
INDEX_KEY = "digen:job-index"
REFUSED_KEY = "digen:refused"
JOB_KWARGS: dict[str, tuple[type, ...]] = {
    "config": (dict,),
    "source_dir": (str, type(None)),
    "out": (str,),
    "resume": (bool,),
}
"""The keyword arguments of :func:`~digen.service.runner.execute_job` and their JSON types
(``config`` and ``out`` required): the whole payload of a digen job."""
MAX_JOB_BYTES = 16 * 1024 * 1024
"""The largest payload (its JSON, once rq has unzipped it) a digen job may have: a config
with its prompts inline is kilobytes; a larger one is refused before it is parsed."""
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


class DigenJob(Job):
    """rq's job, whose payload is unzipped with a bound as it is fetched (by ``digen serve``
    before it forks the work horse, and by ``digen status``): a payload that unzips to more
    than :data:`MAX_JOB_BYTES` (a zip bomb, say) is never unzipped whole nor parsed, and
    :func:`~digen.service.runner.refusal` refuses it."""

    oversized: int | None = None
    """The stored size of a payload over the bound (None: within it)."""

    def restore(self, raw_data) -> Any:
        raw = raw_data.get(b"data") if isinstance(raw_data, dict) else None
        if isinstance(raw, bytes) and _unzipped_size(raw, MAX_JOB_BYTES) > MAX_JOB_BYTES:
            result = super().restore({**raw_data, b"data": b"null"})
            self.oversized = len(raw)
            return result
        return super().restore(raw_data)


def _unzipped_size(raw: bytes, limit: int) -> int:
    """How many bytes ``raw`` unzips to (rq zips payloads; a payload that does not unzip is
    stored as is), counting no further than ``limit + 1``."""
    try:
        return len(zlib.decompressobj().decompress(raw, limit + 1))
    except zlib.error:
        return len(raw)


def info_key(job_id: str) -> str:
    return f"digen:job:{job_id}"


def log_key(job_id: str) -> str:
    return f"digen:job:{job_id}:log"


def alive_key(job_id: str) -> str:
    return f"digen:job:{job_id}:alive"


def attempt_id(job_id: str, attempt: int) -> str:
    """The controller's job id of attempt ``attempt`` of ``job_id``: its keys are
    ``digen:<job id>.<attempt>:*``, so a later attempt finds and deletes a dead one's."""
    return f"{job_id}.{attempt}"


def attempt_keys_pattern(job_id: str) -> str:
    """A Redis MATCH pattern of every attempt's controller keys of ``job_id``."""
    return f"digen:{job_id}.*"


def job_queue(r: redis.Redis) -> Queue:
    return Queue(QUEUE_NAME, connection=r, serializer=JSONSerializer)


RUNNER_PREFIX = "digen:runner:"
RUNNER_TTL_S = 15
"""Seconds a ``digen:runner:<name>`` key lives unless its runner refreshes it."""


def mark_runner(r: redis.Redis, name: str) -> None:
    """``digen serve`` ``name`` is up (refreshed while it waits for a first ``--burst`` job;
    once rq's worker runs, rq's own registration says so)."""
    r.set(RUNNER_PREFIX + name, "up", ex=RUNNER_TTL_S)


def live_runners(r: redis.Redis) -> list[str]:
    """The names of the ``digen serve`` runners up on this Redis: rq's workers registered on
    the job queue (rq drops a dead one's registration after its ``worker_ttl``) and the
    runners still starting (:func:`mark_runner`)."""
    from rq import Worker

    names = {w.name for w in Worker.all(queue=job_queue(r))}
    names |= {_text(k)[len(RUNNER_PREFIX) :] for k in r.scan_iter(match=RUNNER_PREFIX + "*", count=100)}
    return sorted(names)


def note_refused(r: redis.Redis, job_id: str, line: str) -> int:
    """Count one refused rq job (``digen:refused``) and list it in the job index with its
    one-line error, as :func:`list_jobs` shows it; returns the count so far."""
    with r.pipeline() as p:
        p.hincrby(REFUSED_KEY, "count", 1)
        p.hset(REFUSED_KEY, "last", line)
        p.zadd(INDEX_KEY, {job_id: time.time()})
        p.hset(info_key(job_id), mapping={"attempts": 0, "refused": 1})
        p.expire(info_key(job_id), KEEP_S)
        n, *_ = p.execute()
    push_log(r, job_id, line)
    return int(n)


def refused(r: redis.Redis) -> tuple[int, str]:
    """(how many rq jobs the runners refused, the newest refusal's line)."""
    raw: dict[Any, Any] = r.hgetall(REFUSED_KEY)
    return _int(raw.get(b"count")), _text(raw.get(b"last") or b"")


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _int(value: Any) -> int:
    """A count read from Redis; 0 for anything that is not one (junk is not an error here)."""
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0


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
    if r.hexists(info_key(job_id), "refused"):
        raise ConfigError(
            f"job {job_id} was refused (not digen's job, see digen status {job_id}): nothing to resume"
        )
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
    quarantined: int = 0
    """Junk read from Redis (not a task id, not a payload) moved to the dead letters."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _fetch(r: redis.Redis, job_id: str) -> Job:
    from rq.exceptions import NoSuchJobError

    try:
        return DigenJob.fetch(job_id, connection=r, serializer=JSONSerializer)
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
        attempts=_int(info.get(b"attempts")),
        retries_left=int(job.retries_left or 0),
        error=error,
        resumed_from=_text(info.get(b"resumed_from") or b"") or None,
        resumed_by=_text(info.get(b"resumed_by") or b"") or None,
        quarantined=_int(meta.get("quarantined")),
    )


def job_info(r: redis.Redis, job_id: str) -> JobInfo:
    job = _fetch(r, job_id)
    info: dict[Any, Any] = r.hgetall(info_key(job_id))
    return _info_from(job, info, bool(r.exists(alive_key(job_id))))


def list_jobs(r: redis.Redis, limit: int = 20) -> list[JobInfo]:
    """The newest ``limit`` jobs (0: all), newest first. Jobs whose rq record expired are
    dropped from the index."""
    members = r.zrevrange(INDEX_KEY, 0, limit - 1 if limit > 0 else -1)
    ids = [_text(b) for b in members]
    if not ids:
        return []
    with r.pipeline() as p:
        for job_id in ids:
            p.hgetall(info_key(job_id))
            p.exists(alive_key(job_id))
        raw = p.execute()
    out, gone = [], []
    for i, (member, job_id) in enumerate(zip(members, ids, strict=True)):
        try:  # junk in the index or in a job's record is skipped, never fatal
            job = DigenJob.fetch(job_id, connection=r, serializer=JSONSerializer)
            out.append(_info_from(job, raw[2 * i], bool(raw[2 * i + 1])))
        except Exception as exc:  # noqa: BLE001 - rq's NoSuchJobError, a record that does not decode
            if not r.exists(f"rq:job:{job_id}"):
                gone.append(member)
            else:
                log.warning("job %s: its record cannot be read (%s); skipped", job_id, exc)
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
