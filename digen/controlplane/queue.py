"""A reliable task queue in Redis for one job: lease, acknowledge, re-deliver.

Keys (``P = digen:<job_id>:``)::

    P q:<queue>        list   ids of pending tasks, leased from the left (FIFO)
    P task:<id>        hash   queue, payload (msgpack), attempts, state, worker, started (the
                              leasing worker's clock), error, result_kind
    P leases           zset   id -> lease deadline (seconds, Redis server clock)
    P result:<id>      string the result bytes, written once (SET NX)
    P done             list   ids acknowledged, in order; the controller pops it
    P dead             list   ids that failed ``max_attempts`` times
    P wake:<queue>     list   wake-up tokens for blocked ``lease`` calls
    P junk             list   JSON records of what was read and did not parse (quarantined)
    P junk_n           string how many things were quarantined

A task's ``state`` is ``pending`` (its id is in exactly one queue list), ``leased`` (its id is
in ``leases``), ``done`` (its result is stored), ``dead``, or ``parked``: given back by its
worker because an input it needs is gone (a generated group whose worker died before the
trainer fetched it; :meth:`TaskQueue.park`), waiting for the controller to :meth:`repost` it
once the input exists again. :meth:`repost` also runs a done task again (its result, held by a
worker that died before the optimizer step counted it, is lost). Every transition is one Lua
script, so a task is never lost or duplicated between two lists, whoever crashes when.

Clock: lease deadlines use the Redis server's ``TIME`` inside the scripts, so workers with
skewed clocks agree on when a lease expires. ``requeue_expired(now=...)`` may pass an explicit
time on that same clock (tests). Delivery is at least once; results are stored at most once:
the first ``ack`` of a task wins and later ones return False, so a task run twice counts once.

The scripts build key names from the job prefix inside Lua (not cluster-safe: use a single
Redis node or a proxy, as the embedded and docker-compose setups do).

Everything read back is parsed defensively. An id on ``done``, ``dead`` or a queue list that
is not text or (with ``task_ids``, the default) not a digen task id (``kind:iteration:group
[:part]``, or an FSDP ``step:N``), a payload that is not msgpack (a pickle is never
unpickled), a stored result that does not decode: each is *quarantined*, recorded in
``P junk`` with the reason (and passed to ``on_junk``, which the controller points at the
run's ``dead_letters.jsonl``), counted in ``P junk_n`` (``digen status`` shows the count) and
taken out of the way: a junk id is dropped, a task with an unreadable payload or result goes
to the dead letters. An id on a queue list with no task behind it (no ``P task:<id>``) is
junk too, quarantined by :meth:`TaskQueue.lease` as it pops it. The controller only ever sees
valid task ids. It reads a result's bytes as they are stored (:meth:`TaskQueue.raw_result`)
and decodes and checks them as the task's result record (:mod:`digen.controlplane.messages`):
a result that does not read there is quarantined and its task runs again.

Issued ids. The controller's queue (``issued_only``) remembers every id it put or re-posted
(:attr:`TaskQueue.issued`); an id on ``done`` or ``dead`` that it never issued, well-formed
or not, was written there by someone else (anyone who holds the Redis password can) and is
quarantined as junk, never collected or treated as a poison task that fails the job
(``schedule.on_poison: fail``).
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import redis

from digen.controlplane.codec import pack, unpack
from digen.core.events import TaskKind
from digen.errors import PayloadError

log = logging.getLogger(__name__)

STEP_QUEUE = "step"
"""The queue of optimizer step commands (the trainer group's writer, or the FSDP group's
leader, leases and acknowledges them like tasks)."""
STEP_PREFIX = "step:"

_TASK_ID = re.compile(
    r"train:\d{1,9}:\d{1,9}(?::\d{1,9})?"  # :<part>: a half group, or a sample split's mini-batch
    rf"|(?:{'|'.join(k.value for k in TaskKind if k is not TaskKind.TRAIN)}):\d{{1,9}}:\d{{1,9}}(?::[01])?"
    r"|step:\d{1,9}(?::\d{1,9})?"  # a step (step_id; :<mini-batch> with several)
)
JUNK_KEEP = 1000  # quarantine records kept (the count goes on)


def is_task_id(text: str) -> bool:
    """A digen task id: ``kind:iteration:group`` (``:part``: 0 or 1 for half a group; a train
    task's may also be its mini-batch with ``train.mini_batch_split: samples``), or
    ``step:N`` (``step:N:M``: mini-batch M's step of iteration N)."""
    return _TASK_ID.fullmatch(text) is not None


def step_id(iteration: int, mini_batch: int = 0, mini_batches: int = 1) -> str:
    """``step:<iteration>`` (``step:<iteration>:<mini-batch>`` with several mini-batches)."""
    return f"{STEP_PREFIX}{iteration}" if mini_batches == 1 else f"{STEP_PREFIX}{iteration}:{mini_batch}"


def is_step_id(task_id: str) -> bool:
    return task_id.startswith(STEP_PREFIX)


def quarantined_count(redis_client: redis.Redis, job_id: str) -> int:
    """How many things the queue of ``job_id`` quarantined (0 when none, or the keys are gone)."""
    raw = redis_client.get(f"digen:{job_id}:junk_n")
    try:
        return int(raw or 0)
    except ValueError:
        return 0


_MIN_BLOCK_S = 0.01  # BLPOP rounds to milliseconds and treats 0 as "forever"
_MAX_BLOCK_S = 1.0  # re-check at least this often while blocked (tokens lost in a restart)

_PUT = """
local p, q, id = ARGV[1], ARGV[2], ARGV[3]
local tkey = p .. 'task:' .. id
if redis.call('EXISTS', tkey) == 1 then return 0 end
redis.call('HSET', tkey, 'queue', q, 'payload', ARGV[4], 'attempts', 0, 'state', 'pending')
redis.call('RPUSH', p .. 'q:' .. q, id)
redis.call('RPUSH', p .. 'wake:' .. q, 1)
return 1
"""

# {queue, id, payload, attempts, orphans} ({'', '', '', 0, orphans} when nothing to lease):
# orphans are {queue, id} pairs popped with no task behind them (junk, quarantined by the
# caller); an id whose task is in another state (a stale copy) is dropped silently
_LEASE = """
local p, lease_s, worker, started = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local orphans = {}
for i = 5, #ARGV do
  local q = ARGV[i]
  local id = redis.call('LPOP', p .. 'q:' .. q)
  while id do
    local tkey = p .. 'task:' .. id
    local state = redis.call('HGET', tkey, 'state')
    if state == 'pending' then
      local n = redis.call('HINCRBY', tkey, 'attempts', 1)
      redis.call('HSET', tkey, 'state', 'leased', 'worker', worker, 'started', started)
      redis.call('ZADD', p .. 'leases', now + lease_s, id)
      return {q, id, redis.call('HGET', tkey, 'payload'), n, orphans}
    end
    if not state then table.insert(orphans, {q, id}) end
    id = redis.call('LPOP', p .. 'q:' .. q)
  end
end
-- nothing to lease: drop stale wake tokens, atomically with having looked
for i = 5, #ARGV do redis.call('DEL', p .. 'wake:' .. ARGV[i]) end
return {'', '', '', 0, orphans}
"""

_ACK = """
local p, id = ARGV[1], ARGV[2]
local tkey = p .. 'task:' .. id
local state = redis.call('HGET', tkey, 'state')
if not state then return -1 end
if state == 'dead' then return 0 end
local stored = redis.call('SET', p .. 'result:' .. id, ARGV[4], 'NX')
if not stored and state == 'done' then return 0 end
-- stored, or a result is there but the task is not done (written by something else, or the
-- state change lost in a restart): the stored result wins, the task is done either way
if not stored then redis.call('HSETNX', tkey, 'result_kind', ARGV[5]) end
if state == 'pending' then redis.call('LREM', p .. 'q:' .. redis.call('HGET', tkey, 'queue'), 1, id) end
redis.call('ZREM', p .. 'leases', id)
if stored then redis.call('HSET', tkey, 'result_kind', ARGV[5]) end
redis.call('HSET', tkey, 'state', 'done', 'worker', ARGV[3])
redis.call('HDEL', tkey, 'payload')
redis.call('RPUSH', p .. 'done', id)
if stored then return 1 end
return 2
"""

_NACK = """
local p, id, err, max_attempts, worker = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5]
local tkey = p .. 'task:' .. id
if redis.call('HGET', tkey, 'state') ~= 'leased' then return 'ignored' end
if worker ~= '' and redis.call('HGET', tkey, 'worker') ~= worker then return 'ignored' end
redis.call('ZREM', p .. 'leases', id)
redis.call('HSET', tkey, 'error', err)
if tonumber(redis.call('HGET', tkey, 'attempts')) >= max_attempts then
  redis.call('HSET', tkey, 'state', 'dead')
  redis.call('RPUSH', p .. 'dead', id)
  return 'dead'
end
local q = redis.call('HGET', tkey, 'queue')
redis.call('HSET', tkey, 'state', 'pending')
redis.call('HDEL', tkey, 'worker')
redis.call('RPUSH', p .. 'q:' .. q, id)
redis.call('RPUSH', p .. 'wake:' .. q, 1)
return 'requeued'
"""

_EXTEND = """
local p, id, lease_s, worker = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local tkey = p .. 'task:' .. id
if redis.call('HGET', tkey, 'state') ~= 'leased' then return 0 end
if worker ~= '' and redis.call('HGET', tkey, 'worker') ~= worker then return 0 end
local t = redis.call('TIME')
redis.call('ZADD', p .. 'leases', tonumber(t[1]) + tonumber(t[2]) / 1000000 + lease_s, id)
return 1
"""

_PARK = """
local p, id, worker, why = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local tkey = p .. 'task:' .. id
if redis.call('HGET', tkey, 'state') ~= 'leased' then return 0 end
if redis.call('HGET', tkey, 'worker') ~= worker then return 0 end
redis.call('ZREM', p .. 'leases', id)
redis.call('HINCRBY', tkey, 'attempts', -1)
redis.call('HSET', tkey, 'state', 'parked', 'error', why)
redis.call('HDEL', tkey, 'worker')
redis.call('RPUSH', p .. 'parked', id)
return 1
"""

_REPOST = """
local p, id, q, payload = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local tkey = p .. 'task:' .. id
local state = redis.call('HGET', tkey, 'state')
if state == 'leased' then return 'leased' end
if state == 'pending' then
  redis.call('HSET', tkey, 'payload', payload)
  return 'pending'
end
redis.call('DEL', p .. 'result:' .. id)
redis.call('HSET', tkey, 'queue', q, 'payload', payload, 'attempts', 0, 'state', 'pending')
redis.call('HDEL', tkey, 'worker', 'result_kind', 'error')
redis.call('RPUSH', p .. 'q:' .. q, id)
redis.call('RPUSH', p .. 'wake:' .. q, 1)
return state or 'new'
"""

# ARGV: prefix, mode ('expired' | 'worker'), now ('' = server TIME) or worker, max_attempts (0 = none)
_REQUEUE = """
local p, mode, arg, max_attempts = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local ids
if mode == 'expired' then
  local now = tonumber(arg)
  if not now then
    local t = redis.call('TIME')
    now = tonumber(t[1]) + tonumber(t[2]) / 1000000
  end
  ids = redis.call('ZRANGEBYSCORE', p .. 'leases', '-inf', now)
else
  ids = {}
  for _, id in ipairs(redis.call('ZRANGE', p .. 'leases', 0, -1)) do
    if redis.call('HGET', p .. 'task:' .. id, 'worker') == arg then table.insert(ids, id) end
  end
end
local moved = {}
-- latest deadline first, so that after the LPUSHes the earliest one is at the front
for i = #ids, 1, -1 do
  local id = ids[i]
  local tkey = p .. 'task:' .. id
  redis.call('ZREM', p .. 'leases', id)
  if redis.call('HGET', tkey, 'state') == 'leased' then
    local q = redis.call('HGET', tkey, 'queue')
    local n = tonumber(redis.call('HGET', tkey, 'attempts'))
    if max_attempts > 0 and n >= max_attempts then
      local why = 'lease lost ' .. n .. ' times (' .. mode .. ')'
      if redis.call('EXISTS', p .. 'result:' .. id) == 1 then
        why = 'a result for task ' .. id .. ' was already stored, yet the task was leased again ' .. n .. ' times'
      end
      redis.call('HSET', tkey, 'state', 'dead', 'error', why)
      redis.call('RPUSH', p .. 'dead', id)
    else
      redis.call('HSET', tkey, 'state', 'pending')
      redis.call('HDEL', tkey, 'worker')
      redis.call('LPUSH', p .. 'q:' .. q, id)
      redis.call('RPUSH', p .. 'wake:' .. q, 1)
      table.insert(moved, id)
    end
  end
end
return moved
"""


# ARGV: prefix, id, error. A task whose payload or stored result cannot be read: dead, at once.
_KILL = """
local p, id = ARGV[1], ARGV[2]
local tkey = p .. 'task:' .. id
local state = redis.call('HGET', tkey, 'state')
if not state or state == 'dead' then return 0 end
if state == 'pending' then redis.call('LREM', p .. 'q:' .. redis.call('HGET', tkey, 'queue'), 0, id) end
redis.call('ZREM', p .. 'leases', id)
redis.call('DEL', p .. 'result:' .. id)
redis.call('HSET', tkey, 'state', 'dead', 'error', ARGV[3])
redis.call('RPUSH', p .. 'dead', id)
return 1
"""


@dataclass(frozen=True)
class LeasedTask:
    """A task handed to one worker until its lease expires. ``attempt`` counts deliveries (1 = first)."""

    queue: str
    task_id: str
    payload: dict[str, Any]
    attempt: int
    leased_at: float = field(default=0.0, compare=False)
    """The leasing worker's clock just before the lease (the ``started`` it records)."""


@dataclass(frozen=True)
class DeadLetter:
    """A task that failed ``max_attempts`` times, with the last error."""

    task_id: str
    queue: str
    error: str
    attempts: int


class TaskQueue:
    """The task queues of one job (see the module docstring for keys and guarantees).

    Thread-safe (one ``redis.Redis`` client is a connection pool). ``lease_s`` is how long a
    worker may hold a task without :meth:`extend` before it is re-delivered.
    """

    def __init__(
        self,
        redis_client: redis.Redis,
        job_id: str,
        *,
        lease_s: float = 30.0,
        task_ids: bool = True,
        on_junk: Callable[[dict[str, Any]], None] | None = None,
        issued_only: bool = False,
    ):
        if not job_id or any(c in job_id for c in " \t\n*?[]"):
            raise ValueError(f"job_id {job_id!r} must be non-empty, without spaces or glob characters")
        if redis_client.connection_pool.connection_kwargs.get("decode_responses"):
            raise ValueError("TaskQueue needs a bytes client (decode_responses=False), as connect() returns")
        self.redis = redis_client
        self.job_id = job_id
        self.lease_s = float(lease_s)
        self.task_ids = task_ids
        """Accept only digen task ids (:func:`is_task_id`); False: any text (benchmarks, tests)."""
        self.on_junk = on_junk
        """Called with each quarantine record (the controller appends it to dead_letters.jsonl)."""
        self.issued: set[str] | None = set() if issued_only else None
        """The controller's queue: every id this instance put or re-posted; an id on ``done``
        or ``dead`` outside it is quarantined (module docstring). None: any id is taken."""
        self.prefix = f"digen:{job_id}:"
        self._put = redis_client.register_script(_PUT)
        self._lease = redis_client.register_script(_LEASE)
        self._ack = redis_client.register_script(_ACK)
        self._nack = redis_client.register_script(_NACK)
        self._extend = redis_client.register_script(_EXTEND)
        self._requeue = redis_client.register_script(_REQUEUE)
        self._park = redis_client.register_script(_PARK)
        self._repost = redis_client.register_script(_REPOST)
        self._kill = redis_client.register_script(_KILL)
        timeout = redis_client.connection_pool.connection_kwargs.get("socket_timeout")
        # a blocking call longer than the socket timeout would be cut (and retried) by redis-py
        self._block_slice = min(_MAX_BLOCK_S, timeout / 2) if timeout else _MAX_BLOCK_S

    # -- producer -------------------------------------------------------------------------

    def put(self, queue_name: str, task_id: str, payload: dict[str, Any]) -> bool:
        """Queue ``task_id`` at the back of ``queue_name``. Returns False (and changes
        nothing) when this job already has a task with that id, in any state."""
        self._issue(task_id)
        return bool(self._put(args=[self.prefix, queue_name, task_id, pack(payload)]))

    def put_many(self, queue_name: str, tasks: list[tuple[str, dict[str, Any]]]) -> int:
        """:meth:`put` of ``[(task_id, payload), ...]`` in one round trip; returns how many were new."""
        pipe = self.redis.pipeline(transaction=False)
        for task_id, payload in tasks:
            self._issue(task_id)
            self._put(args=[self.prefix, queue_name, task_id, pack(payload)], client=pipe)
        return sum(int(x) for x in pipe.execute())

    def put_all(self, tasks: list[tuple[str, str, dict[str, Any]]]) -> list[bool]:
        """:meth:`put` of ``[(queue_name, task_id, payload), ...]`` in one round trip, in order;
        per task whether it was new. One transaction: a worker woken by the first finds them
        all queued."""
        pipe = self.redis.pipeline(transaction=True)
        for queue_name, task_id, payload in tasks:
            self._issue(task_id)
            self._put(args=[self.prefix, queue_name, task_id, pack(payload)], client=pipe)
        return [bool(int(x)) for x in pipe.execute()]

    # -- worker ---------------------------------------------------------------------------

    def lease(self, queue_names: list[str], worker: str, *, block_s: float = 0) -> LeasedTask | None:
        """Take the first pending task of the first non-empty queue in ``queue_names``
        (priority order). With ``block_s > 0`` wait up to that long for one (BLPOP on wake
        tokens, no busy loop). None when there is nothing to do. A task whose payload is not
        valid msgpack (a pickle, say: never unpickled) goes to the dead letters at once."""
        if not queue_names:
            raise ValueError("lease() needs at least one queue name")
        deadline = time.monotonic() + block_s
        wake_keys = [self._key("wake", q) for q in queue_names]
        while True:
            now = time.time()
            queue, raw_id, payload, attempt, orphans = self._lease(
                args=[self.prefix, self.lease_s, worker, repr(now), *queue_names]
            )
            for orphan_queue, orphan in orphans:  # ids that no task stands behind
                self._quarantine(f"q:{_text(orphan_queue)}", orphan, self._orphan_problem(orphan))
            if raw_id:
                task_id = self._task_id(raw_id)
                if task_id is None:  # junk on a queue list: dropped with its lease
                    self.redis.zrem(self.prefix + "leases", raw_id)
                    self._quarantine(f"q:{_text(queue)}", raw_id, self._id_problem(raw_id))
                    continue
                try:
                    return LeasedTask(_text(queue), task_id, unpack(payload), int(attempt), now)
                except PayloadError as err:  # never runs: straight to the dead letters, lease the next
                    self.nack(task_id, f"PayloadError: {err}", max_attempts=1, worker=worker)
                    self._quarantine(f"task:{task_id}", payload, f"payload of task {task_id}: {err}")
                    continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            self.redis.blpop(wake_keys, timeout=self._slice(remaining))

    def wait(self, queue_names: list[str], worker: str, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for a task put in one of ``queue_names`` (since the last
        :meth:`lease` of them found nothing) or a :meth:`wake` of ``worker``, whichever first;
        True when woken. Idle workers wait here instead of polling: no round trip while
        nothing happens."""
        keys = [self._key("wake", q) for q in queue_names] + [self._key("wake", f"w:{worker}")]
        deadline = time.monotonic() + timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            if self.redis.blpop(keys, timeout=self._slice(remaining)):
                return True
        return False

    def wake(self, *workers: str) -> None:
        """Wake ``workers`` from :meth:`wait` (their role tag or the trainer group's step
        command changed)."""
        if workers:
            pipe = self.redis.pipeline(transaction=False)
            for w in workers:
                pipe.rpush(self._key("wake", f"w:{w}"), 1)
                pipe.expire(self._key("wake", f"w:{w}"), 60)
            pipe.execute()

    def ack(self, task_id: str, result: bytes | dict[str, Any], *, worker: str) -> bool:
        """Store ``result`` (raw bytes, or a dict packed with msgpack), end the lease and push
        ``task_id`` onto the done list, atomically. True if this call stored the result;
        False if a result was already stored (the task ran twice) or the task is dead."""
        kind, data = (
            ("bytes", result)
            if isinstance(result, bytes | bytearray | memoryview)
            else ("msgpack", pack(result))
        )
        stored = int(self._ack(args=[self.prefix, task_id, worker, bytes(data), kind]))
        if stored < 0:
            log.warning("ack of unknown task %s in job %s by %s ignored", task_id, self.job_id, worker)
        elif stored == 2:
            log.warning(
                "a result for task %s of job %s was already stored; the task is done with that one, "
                "this result from %s is discarded",
                task_id,
                self.job_id,
                worker,
            )
        return stored == 1

    def nack(self, task_id: str, error: str, *, max_attempts: int, worker: str | None = None) -> str:
        """Report a failed attempt: re-queue the task at the back of its queue, or after
        ``max_attempts`` deliveries move it to the dead list with ``error``. Returns
        ``"requeued"``, ``"dead"`` or ``"ignored"`` (not leased, or leased by another worker
        than ``worker`` when given)."""
        reply = self._nack(args=[self.prefix, task_id, error, max_attempts, worker or ""])
        outcome = reply.decode() if isinstance(reply, bytes) else str(reply)
        if outcome == "dead":  # the first line: the traceback stays in the dead letter
            first = (error.strip().splitlines() or ["no error recorded"])[0]
            log.warning(
                "task %s of job %s is dead after %d attempts: %s", task_id, self.job_id, max_attempts, first
            )
        return outcome

    def park(self, task_id: str, *, worker: str, why: str) -> bool:
        """Give a leased task back without counting an attempt because an input it needs is
        gone (``why``); it waits, state ``parked``, until :meth:`repost`. The id goes onto the
        ``parked`` list the controller reads (:meth:`pop_parked`). False when ``worker`` does
        not hold its lease (nothing changes)."""
        return bool(self._park(args=[self.prefix, task_id, worker, why]))

    def extend(self, task_id: str, *, worker: str | None = None) -> bool:
        """Renew the lease of a task still leased (by ``worker`` when given) for ``lease_s``
        from now. False means the lease is lost: another worker may be running the task."""
        return bool(self._extend(args=[self.prefix, task_id, self.lease_s, worker or ""]))

    # -- controller -----------------------------------------------------------------------

    def requeue_expired(self, now: float | None = None, *, max_attempts: int = 0) -> list[str]:
        """Move every task whose lease deadline is <= ``now`` (Redis server clock; default
        its ``TIME``) back to the FRONT of its queue; with ``max_attempts`` > 0 a task that
        has been delivered that many times goes to the dead list instead. Returns the ids
        re-queued, earliest deadline first."""
        arg = "" if now is None else repr(float(now))
        return self._run_requeue("expired", arg, max_attempts)

    def repost(self, queue_name: str, task_id: str, payload: dict[str, Any]) -> str:
        """Run ``task_id`` (again): a parked, done or dead task is queued anew with ``payload``
        and no attempts (a done one loses its result), a pending one gets ``payload``, an
        unknown one is put. A leased one is left to its worker (returns ``"leased"``). Returns
        the state the task was in (``"new"`` for an unknown one)."""
        self._issue(task_id)
        reply = self._repost(args=[self.prefix, task_id, queue_name, pack(payload)])
        return reply.decode() if isinstance(reply, bytes) else str(reply)

    def pop_parked(self) -> list[tuple[str, str]]:
        """(task id, why) of the tasks parked since the last call."""
        key = self.prefix + "parked"
        popped = cast("list[bytes | str]", self.redis.lpop(key, 1_000_000) or [])
        ids = [_text(b) for b in popped]
        pipe = self.redis.pipeline(transaction=False)
        for task_id in ids:
            pipe.hget(self._key("task", task_id), "error")
        return [(t, _text(e or b"")) for t, e in zip(ids, pipe.execute() if ids else [], strict=True)]

    def requeue_worker(self, worker: str, *, max_attempts: int = 0) -> list[str]:
        """Like :meth:`requeue_expired` for every task leased by ``worker`` (known dead)."""
        return self._run_requeue("worker", worker, max_attempts)

    def pop_done(self, timeout_s: float = 0) -> list[str]:
        """Drain the done list: wait up to ``timeout_s`` for the first id, then take all."""
        key = self.prefix + "done"
        first: list[Any] = []
        deadline = time.monotonic() + timeout_s
        while timeout_s > 0 and not first:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            reply = self.redis.blpop([key], timeout=self._slice(remaining))
            if reply:
                first = [reply[1]]
        rest: list[Any] = self.redis.lpop(key, 1_000_000) or []  # type: ignore[assignment]
        ids = []
        for raw in [*first, *rest]:
            task_id = self._task_id(raw)
            if task_id is None:
                self._quarantine("done", raw, self._id_problem(raw))
            elif not self._was_issued(task_id):
                self._quarantine("done", raw, self._not_issued(task_id))
            else:
                ids.append(task_id)
        return ids

    def get_result(self, task_id: str) -> bytes | dict[str, Any] | None:
        """The stored result of ``task_id`` (bytes, or the dict given to :meth:`ack`), or None."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.get(self._key("result", task_id))
        pipe.hget(self._key("task", task_id), "result_kind")
        data, kind = pipe.execute()
        if data is None:
            return None
        try:
            return self._decode_result(data, kind)
        except PayloadError as err:  # a result no worker wrote: the task goes to the dead letters
            why = f"the stored result of task {task_id} is not a digen result ({err})"
            self._quarantine(f"result:{task_id}", data, why)
            self._kill(args=[self.prefix, task_id, f"PayloadError: {why}"])
            return None

    def raw_result(self, task_id: str) -> bytes | None:
        """The stored result bytes of ``task_id`` as they are (None: none), for a reader that
        decodes and checks them itself (the controller: :mod:`digen.controlplane.messages`,
        which quarantines what does not read and runs the task again)."""
        data = self.redis.get(self._key("result", task_id))
        return None if data is None else bytes(data)  # type: ignore[arg-type]

    def results(self, prefix: str = "") -> dict[str, bytes | dict[str, Any]]:
        """All stored results whose task id starts with ``prefix``, by task id."""
        base = self._key("result", "")
        keys = list(self.redis.scan_iter(match=_glob_escape(base + prefix) + "*", count=1000))
        if not keys:
            return {}
        ids = [_text(k)[len(base) :] for k in keys]
        pipe = self.redis.pipeline(transaction=False)
        for key, task_id in zip(keys, ids, strict=True):
            pipe.get(key)
            pipe.hget(self._key("task", task_id), "result_kind")
        replies = pipe.execute()
        out: dict[str, bytes | dict[str, Any]] = {}
        for i, task_id in enumerate(ids):
            if replies[2 * i] is None:
                continue
            try:
                out[task_id] = self._decode_result(replies[2 * i], replies[2 * i + 1])
            except PayloadError as err:
                self._quarantine(f"result:{task_id}", replies[2 * i], f"stored result of {task_id}: {err}")
        return out

    def dead_letters(self) -> list[DeadLetter]:
        """The dead tasks, oldest first, with their last error."""
        out = []
        for raw in self.redis.lrange(self.prefix + "dead", 0, -1):
            task_id = self._task_id(raw)
            if task_id is None or not self._was_issued(task_id):  # pushed there: taken off it
                self.redis.lrem(self.prefix + "dead", 0, raw)  # type: ignore[arg-type]  # bytes as stored
                why = self._id_problem(raw) if task_id is None else self._not_issued(task_id)
                self._quarantine("dead", raw, why)
                continue
            queue, error, attempts = self.redis.hmget(
                self._key("task", task_id), ["queue", "error", "attempts"]
            )
            out.append(DeadLetter(task_id, _text(queue or b""), _text(error or b""), _int(attempts)))
        return out

    def quarantined(self) -> list[dict[str, Any]]:
        """The newest quarantine records (``JUNK_KEEP``), oldest first."""
        out = []
        for raw in self.redis.lrange(self.prefix + "junk", 0, -1):
            try:
                out.append(json.loads(raw))
            except ValueError:
                continue
        return out

    def quarantined_count(self) -> int:
        """How many things this queue quarantined."""
        return quarantined_count(self.redis, self.job_id)

    def progress(self, task_ids: list[str]) -> dict[str, tuple[str | None, float | None]]:
        """(state, when the leasing worker took it by its clock) of each id, in one round trip."""
        pipe = self.redis.pipeline(transaction=False)
        for task_id in task_ids:
            pipe.hmget(self._key("task", task_id), ["state", "started"])
        return {
            task_id: (None if state is None else _text(state), _float(started))
            for task_id, (state, started) in zip(task_ids, pipe.execute() if task_ids else [], strict=True)
        }

    def state(self, task_id: str) -> str | None:
        """``pending``, ``leased``, ``done``, ``dead``, or None for an unknown id."""
        raw = self.redis.hget(self._key("task", task_id), "state")
        return _text(raw) if raw is not None else None

    def pending_count(self, queue_name: str) -> int:
        """Tasks waiting in ``queue_name``."""
        return int(self.redis.llen(self._key("q", queue_name)))

    def leased_count(self) -> int:
        """Tasks currently leased by some worker (expired leases included until re-queued)."""
        return int(self.redis.zcard(self.prefix + "leases"))

    def clear(self) -> int:
        """Delete every key of this job; returns how many."""
        n = 0
        batch: list[bytes] = []
        for key in self.redis.scan_iter(match=_glob_escape(self.prefix) + "*", count=1000):
            batch.append(key)
            if len(batch) >= 1000:
                n += int(self.redis.unlink(*batch))
                batch = []
        if batch:
            n += int(self.redis.unlink(*batch))
        return n

    # -- internals ------------------------------------------------------------------------

    def _key(self, kind: str, name: str) -> str:
        return f"{self.prefix}{kind}:{name}"

    def _task_id(self, raw: bytes | str) -> str | None:
        """``raw`` as a task id, or None when it is not one (not UTF-8, or not a task id)."""
        try:
            text = raw.decode() if isinstance(raw, bytes) else str(raw)
        except UnicodeDecodeError:
            return None
        if self.task_ids and not is_task_id(text):
            return None
        if not self.task_ids and (not text or any(c in text for c in "\r\n\x00")):
            return None
        return text

    def _issue(self, task_id: str) -> None:
        if self.issued is not None:
            self.issued.add(task_id)

    def _was_issued(self, task_id: str) -> bool:
        return self.issued is None or task_id in self.issued

    @staticmethod
    def _not_issued(task_id: str) -> str:
        return f"task id {task_id!r} was never issued by this job's controller"

    def _orphan_problem(self, raw: bytes | str) -> str:
        task_id = self._task_id(raw)
        if task_id is None:
            return self._id_problem(raw)
        return f"no task {task_id!r} stands behind this id on a queue list"

    def _id_problem(self, raw: bytes | str) -> str:
        try:
            text = raw.decode() if isinstance(raw, bytes) else str(raw)
        except UnicodeDecodeError as err:
            return f"not a task id: not UTF-8 text (byte 0x{raw[err.start]:02x} at offset {err.start})"
        return f"not a task id (kind:iteration:group[:part]): {text[:80]!r}"

    def quarantine(self, where: str, raw: Any, reason: str) -> None:
        """Quarantine junk a worker read from one of the job's other keys (``where``, relative
        to the job's prefix: a step command in ``tg:step`` that does not read, say), recorded
        and counted as the queue's own junk is."""
        self._quarantine(where, raw, reason)

    def _quarantine(self, where: str, raw: Any, reason: str) -> None:
        """Record junk read from ``where`` (see the module docstring); never raises for Redis."""
        shown = repr(raw[:80]) if isinstance(raw, bytes | str) else repr(raw)[:80]
        record = {"junk": shown, "from": self.prefix + where, "reason": reason, "time": time.time()}
        log.warning(
            "job %s: quarantined %s from %s (%s): moved to the dead letters",
            self.job_id,
            shown,
            where,
            reason,
        )
        with self.redis.pipeline(transaction=False) as p:
            p.rpush(self.prefix + "junk", json.dumps(record))
            p.ltrim(self.prefix + "junk", -JUNK_KEEP, -1)
            p.incr(self.prefix + "junk_n")
            p.execute()
        if self.on_junk is not None:
            try:
                self.on_junk({"task": None, "action": "quarantined", **record})
            except Exception as exc:  # noqa: BLE001 - the record is in Redis either way
                log.warning("could not record quarantined junk: %s", exc)

    def _slice(self, remaining: float) -> float:
        return max(_MIN_BLOCK_S, min(remaining, self._block_slice))

    def _run_requeue(self, mode: str, arg: str, max_attempts: int) -> list[str]:
        moved = self._requeue(args=[self.prefix, mode, arg, max_attempts])
        ids = [_text(b) for b in reversed(moved)]
        if ids:
            log.info("job %s: re-queued %d task(s) (%s %s)", self.job_id, len(ids), mode, arg or "now")
        return ids

    @staticmethod
    def _decode_result(data: bytes, kind: bytes | None) -> bytes | dict[str, Any]:
        return unpack(data) if kind == b"msgpack" else data


def _text(raw: bytes | str) -> str:
    """Text read from Redis; undecodable bytes replaced (for messages, never for ids)."""
    return raw.decode(errors="replace") if isinstance(raw, bytes) else raw


def _int(raw: Any) -> int:
    try:
        return int(raw or 0)
    except (TypeError, ValueError):
        return 0


def _float(raw: Any) -> float | None:
    try:
        return None if raw is None else float(raw)
    except (TypeError, ValueError):
        return None


def _glob_escape(text: str) -> str:
    """Escape Redis MATCH pattern characters."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)
