"""Fault injection: make a worker die, stall, lose Redis or fail a task at a named point.

The worker loop calls :func:`point` at each named place of a task:

``gen``    a generation task has generated and scored its group, nothing is stored yet
``train``  a train task has computed its gradient, nothing is stored yet
``sync``   a worker has fetched a weights version (or a trainer the optimizer state), before loading it
``ack``    a task's data is stored (in the worker's blob store), before its acknowledgement
``acked``  a task's acknowledgement won (its data is this worker's to serve from now on)
``fetch``  a task is about to fetch its input (a generated group) from the worker that made it
``reduce`` a trainer of a group of two or more is in the step's process group, about to
           all-reduce
``reduced`` a member of the trainer group holds the step's summed gradient, before it
           reports its reduction (``iteration``: the step's iteration)
``reported`` a member has reported its reduction (``SADD ...tg:ok:<step>:<epoch>``), before it
           waits for the step's decision
``checkpoint`` a step's writer is about to stage its checkpoint
``start``  a worker loop starts, before it loads the model (``raise`` here crashes the loop)

:func:`point` does nothing unless the worker process runs with ``DIGEN_FAULTS=1`` (set it
before the cluster starts: local Dask workers inherit the environment). Then it reads the
job's fault plan from Redis, which a test writes with :func:`arm`::

    arm(r, job_id, Fault("gen", "kill", worker="rollout-0", iteration=1))

Actions:

``kill``        SIGKILL this worker process (its Nanny restarts it; its lease is re-queued);
                with a ``flag``, the flag is set first (another worker holds on it)
``stall``       sleep ``seconds`` (longer than ``schedule.lease_s``: the task is re-delivered)
``drop_redis``  close this process's Redis connections; new ones are refused for ``seconds``
``raise``       the task raises :class:`InjectedFault` (a poison task when ``times`` >=
                ``schedule.max_attempts``)
``signal``      set the job's flag ``flag`` (the task goes on)
``hold``        wait until the flag ``flag`` is set, then go on: an order between two
                workers' tasks that does not depend on their speeds. ``seconds`` only
                guards against a deadlock: a hold that outlives it goes on and records
                ``hold_expired`` in :func:`fired`. After a hold the next armed fault
                matching the same place may fire too (in the order armed): a ``hold`` then a
                ``kill`` kills a worker the moment another one got somewhere

A fault fires ``times`` times in all, whichever processes hit it (claimed atomically in
Redis, so a restarted worker does not die again). :func:`fired` lists what fired.

Keys (outside the job's ``digen:<job>:`` prefix, so they survive the job's clean-up)::

    digen:faults:<job>:plan   hash  fault id -> JSON spec
    digen:faults:<job>:left   hash  fault id -> firings left
    digen:faults:<job>:fired  list  JSON {fault, point, action, worker, task, iteration, pid, t}
    digen:faults:<job>:flags  set   flags set by ``signal`` faults
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from dataclasses import asdict, dataclass
from typing import Literal

log = logging.getLogger(__name__)

ENV = "DIGEN_FAULTS"
POINTS = (
    "gen",
    "train",
    "sync",
    "ack",
    "acked",
    "fetch",
    "start",
    "reduce",
    "reduced",
    "reported",
    "checkpoint",
)
Action = Literal["kill", "stall", "drop_redis", "raise", "signal", "hold"]


class InjectedFault(RuntimeError):
    """The error a ``raise`` fault throws inside a task."""


@dataclass(frozen=True)
class Fault:
    """Where and how to fail. ``worker``, ``task`` and ``iteration`` filter the hits (None:
    any); ``iteration`` of a ``sync`` point is the weights version being loaded."""

    point: str
    action: Action
    worker: str | None = None
    task: str | None = None
    iteration: int | None = None
    seconds: float = 0.0
    times: int = 1
    flag: str = ""
    """What a ``signal`` fault sets and a ``hold`` fault waits for."""

    def matches(self, where: str, worker: str, task: str, iteration: int | None) -> bool:
        return (
            self.point == where
            and self.worker in (None, worker)
            and self.task in (None, task)
            and self.iteration in (None, iteration)
        )


def _keys(job_id: str) -> tuple[str, str, str, str]:
    p = f"digen:faults:{job_id}:"
    return p + "plan", p + "left", p + "fired", p + "flags"


def arm(r, job_id: str, *faults: Fault) -> None:
    """Add ``faults`` to the plan of ``job_id`` (Redis client ``r``)."""
    plan, left, _, _ = _keys(job_id)
    for f in faults:
        if f.point not in POINTS:
            raise ValueError(f"fault point {f.point!r} is not one of {POINTS}")
        if f.action in ("signal", "hold") and not f.flag:
            raise ValueError(f"a {f.action} fault needs a flag")
        fid = f"f{r.hlen(plan)}"
        r.hset(plan, fid, json.dumps(asdict(f)))
        r.hset(left, fid, f.times)


def fired(r, job_id: str) -> list[dict]:
    """What fired so far, in order."""
    return [json.loads(x) for x in r.lrange(_keys(job_id)[2], 0, -1)]


def clear(r, job_id: str) -> None:
    r.delete(*_keys(job_id))


def point(where: str, job, worker: str, *, task: str = "", iteration: int | None = None) -> None:
    """The hook: fire the first armed fault matching this place (``job``: the worker's
    :class:`~digen.controlplane.jobstate.JobState`). A no-op without ``DIGEN_FAULTS=1``."""
    if os.environ.get(ENV) != "1":
        return
    r = job.r
    plan, left, done, flags = _keys(job.job_id)
    for fid, raw in sorted(r.hgetall(plan).items(), key=lambda kv: int(kv[0][1:])):  # armed order
        f = Fault(**json.loads(raw))
        if not f.matches(where, worker, task, iteration):
            continue
        if r.hincrby(left, fid, -1) < 0:
            continue  # used up (another process claimed the last firing)
        record = {
            "fault": fid.decode(),
            "point": where,
            "action": f.action,
            "worker": worker,
            "task": task,
            "iteration": iteration,
            "pid": os.getpid(),
            "t": time.time(),
        }
        r.rpush(done, json.dumps(record))
        log.warning("injected fault %s: %s at %s (%s, task %s)", fid.decode(), f.action, where, worker, task)
        if f.action in ("signal", "kill") and f.flag:
            r.sadd(flags, f.flag)
        if f.action == "hold":
            if not _hold(r, flags, f):
                r.rpush(done, json.dumps({**record, "action": "hold_expired", "t": time.time()}))
            continue  # a fault armed after it at the same place may fire now
        if f.action != "signal":
            _act(f, r)
        return


def _hold(r, flags: str, f: Fault) -> bool:
    """Wait until ``f.flag`` is set (True), or ``f.seconds`` passed (False)."""
    deadline = time.monotonic() + f.seconds
    while not r.sismember(flags, f.flag):
        if time.monotonic() > deadline:
            log.warning("fault hold on flag %r expired after %g s", f.flag, f.seconds)
            return False
        time.sleep(0.01)
    return True


def _act(f: Fault, r) -> None:
    if f.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif f.action == "stall":
        time.sleep(f.seconds)
    elif f.action == "drop_redis":
        _refuse_redis(r, f.seconds)
    elif f.action == "raise":
        raise InjectedFault("injected fault at this task (a reward that raises, say)")
    else:
        raise ValueError(f"unknown fault action {f.action!r}")


def _refuse_redis(r, seconds: float) -> None:
    """Close every connection of ``r``'s pool; new ones are refused for ``seconds``."""
    cls = r.connection_pool.connection_class
    until = time.monotonic() + seconds
    real = getattr(cls, "_digen_real_connect", cls._connect)

    def refuse(self):
        if time.monotonic() < until:
            raise ConnectionRefusedError(111, "Connection refused (injected fault)")
        return real(self)

    cls._digen_real_connect = real
    cls._connect = refuse
    r.connection_pool.disconnect()
