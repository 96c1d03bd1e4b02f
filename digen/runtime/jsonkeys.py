"""One job's Redis keys under a section prefix, with JSON values: what the trainer group, the
FSDP group and the sequence-parallel replicas keep in Redis is read and written the same way.

A group's keys are ``digen:<job_id>:<section>:<name>`` (cleared with the job's other keys);
a value is JSON text (no pickle: Redis may be shared), and a key that is not set reads as
None. A rendezvous address is the JSON ``{"host", "port", "backend"}`` of the TCPStore that
the group's rank 0 serves (:func:`digen.parallel.comm.join_process_group` writes and reads it).
"""

from __future__ import annotations

import json
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

    def set_rendezvous(self, key: str, host: str, port: int, backend: str) -> None:
        self.set_json(key, {"host": host, "port": port, "backend": backend})
