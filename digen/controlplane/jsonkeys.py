"""One job's Redis keys under a section prefix, with JSON values: the trainer group, the FSDP
group and the sequence-parallel replicas keep their keys in Redis the same way.

A group's keys are ``digen:<job_id>:<section>:<name>`` (cleared with the job's other keys);
a value is JSON text (no pickle: Redis may be shared), and a key that is not set reads as
None. Each group forms its torch.distributed process group through a :class:`Rendezvous`
key: rank 0 publishes the JSON ``{"host", "store", "backend"}`` of one formation and the
other ranks poll for it; every rank then meets the others in a
:class:`~digen.parallel.store.RedisStore` under ``<key>:store:<store>:``, in the job's Redis
(:func:`digen.parallel.comm.join_process_group`): no rendezvous port is opened.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class JsonKeys:
    """The keys of one section of one job (subclasses name what each key holds)."""

    def __init__(self, redis_client, job_id: str, section: str):
        self.r = redis_client
        self.p = f"digen:{job_id}:{section}:"

    def set_json(self, key: str, value: Any) -> None:
        self.r.set(self.p + key, json.dumps(value))

    def get_json(self, key: str) -> Any | None:
        raw = self.r.get(self.p + key)
        return None if raw is None else json.loads(raw)


@dataclass(frozen=True)
class Rendezvous:
    """The key where one process group's rank 0 publishes its formation (host, store name,
    backend), and the store the ranks then meet in."""

    keys: JsonKeys
    key: str
    what: str
    """What the other ranks wait for, as a log line names it."""
    gone: Callable[[], str | None] = lambda: None
    """Why the address will never come (its leader left), or None while it may."""

    def publish(self, addr: dict) -> None:
        self.keys.set_json(self.key, addr)

    def store(self, name: str, timeout):
        """The torch.distributed store of formation ``name``, in the job's Redis (torch is
        imported here, never by the controller, which only reads and clears these keys)."""
        from digen.parallel.store import RedisStore

        return RedisStore(self.keys.r, f"{self.keys.p}{self.key}:store:{name}:", timeout)

    def poll(self) -> dict | None:
        """The address; ``{"gone": why}`` once it will never come; None until either."""
        addr = self.keys.get_json(self.key)
        if addr is not None:
            return addr
        why = self.gone()
        return None if why is None else {"gone": why}
