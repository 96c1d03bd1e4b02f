"""torch.distributed's key-value store over the job's Redis: the rendezvous of every process
group digen forms (the trainer group, the FSDP group, the sequence-parallel replicas).

Why not ``TCPStore``: its server authenticates no one. Whoever reaches its port reads and
writes the group's keys (the ranks' gloo and NCCL addresses, NCCL's unique id) and can
join, stall or redirect the group; on a shared machine that is every local user, even with
the store bound to loopback. The job's Redis already is the one place the job trusts (a unix
socket in a 0700 folder for the embedded server, a password or ACL and TLS for a shared one;
docs/deploy.md), every rank already holds a connection to it, and a rendezvous is a few small
keys. So :class:`RedisStore` implements ``torch.distributed.Store`` on it, under a prefix
that names the job, the group and one formation of it (a fresh random name each time a group
forms, so a re-formed group never reads a dead formation's keys), and no rendezvous port
is opened at all.

Cost: the ranks poll Redis while they wait for each other's keys (every ``poll_s``, 10 ms),
during ``init_process_group`` and NCCL's lazy communicator set-up only; a formation of N
ranks writes O(N) small keys, kept until the job's keys are cleared (a group forms again only
when its membership changes, so they stay few; they must outlive the formation itself, since
NCCL sets up communicators lazily at the first collective). The client is any ``redis.Redis``-like object
(``set``, ``get``, ``incrby``, ``exists``, ``delete``, ``eval``, ``scan_iter``): this module
imports no Redis package.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from datetime import timedelta

import torch.distributed as dist

POLL_S = 0.01
"""How often a rank waiting for a key asks Redis again (seconds)."""

_COMPARE_SET = """
local cur = redis.call('GET', KEYS[1])
if (cur == false and ARGV[1] == '') or cur == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2])
  return ARGV[2]
end
if cur == false then return ARGV[1] end
return cur
"""

_StoreError = getattr(dist, "DistStoreError", RuntimeError)


def _bytes(value) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode()
    return bytes(value)  # a list of ints, as pybind hands a std::vector<uint8_t>


class RedisStore(dist.Store):
    """A ``torch.distributed.Store`` whose keys live in Redis under ``prefix``.

    ``get`` and ``wait`` block until the keys exist or ``timeout`` passes (then
    ``DistStoreError``, as ``TCPStore``'s). ``add`` is Redis's ``INCRBY``; ``compare_set``
    one Lua script (atomic, as torch requires)."""

    def __init__(self, client, prefix: str, timeout: timedelta, poll_s: float = POLL_S):
        super().__init__()
        self._r, self._p, self._timeout, self._poll_s = client, prefix, timeout, poll_s

    # --- writes --------------------------------------------------------------------------------
    def set(self, key: str, value) -> None:
        self._r.set(self._p + key, _bytes(value))

    def add(self, key: str, amount: int) -> int:
        return int(self._r.incrby(self._p + key, int(amount)))

    def compare_set(self, key: str, expected, desired) -> bytes:
        got = self._r.eval(_COMPARE_SET, 1, self._p + key, _bytes(expected), _bytes(desired))
        return _bytes(got)

    def delete_key(self, key: str) -> bool:
        return bool(self._r.delete(self._p + key))

    # --- reads ---------------------------------------------------------------------------------
    def get(self, key: str) -> bytes:
        self.wait([key])
        value = self._r.get(self._p + key)
        if value is None:  # deleted between the wait and the read
            raise _StoreError(f"rendezvous key {key!r} vanished")
        return bytes(value)

    def check(self, keys: Iterable[str]) -> bool:
        keys = list(keys)
        return not keys or int(self._r.exists(*(self._p + k for k in keys))) == len(keys)

    def wait(self, keys: Iterable[str], timeout: timedelta | None = None) -> None:
        keys = list(keys)
        limit = (timeout or self._timeout).total_seconds()
        deadline = time.monotonic() + limit
        while not self.check(keys):
            if time.monotonic() > deadline:
                raise _StoreError(f"rendezvous keys {keys} not set within {limit:g} s")
            time.sleep(self._poll_s)

    def num_keys(self) -> int:
        return sum(1 for _ in self._r.scan_iter(match=_glob_escape(self._p) + "*", count=1000))

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)
