"""The FSDP trainer group's keys in Redis (``train.fsdp: true``): what its ranks
(:mod:`digen.workers.fsdp_loop`) and the controller (:mod:`digen.runtime.fsdp_group`) both read.

Keys (``P = digen:<job_id>:``, cleared with the job's other keys)::

    P fsdp:plan      string  JSON {"members": [sorted trainer names], "version": v,
                             "checkpoint": folder or null}: written once by the controller at
                             job start (a resumed job's ranks load the checkpoint)
    P fsdp:store     string  JSON {"host", "store", "backend"}: rank 0's formation, for the others
    P fsdp:joined    hash    member -> 1 once its loop joined (a second join is a restart)
    P fsdp:error     string  the first rank failure (set once)
    P q:step         list    step commands ``step:<iteration>`` (``step:<iteration>:<mini-batch>``
                             with several mini-batches): the task queue's
                             (:data:`~digen.controlplane.queue.STEP_QUEUE`)
"""

from __future__ import annotations

from digen.controlplane.jsonkeys import JsonKeys, Rendezvous


class FsdpGroup(JsonKeys):
    """The group's rendezvous and failure keys in Redis (JSON only)."""

    def __init__(self, redis_client, job_id: str):
        super().__init__(redis_client, job_id, "fsdp")

    def set_plan(self, plan: dict) -> None:
        self.set_json("plan", plan)

    def plan(self) -> dict | None:
        return self.get_json("plan")

    def rendezvous(self) -> Rendezvous:
        return Rendezvous(self, "store", "the FSDP rendezvous address")

    def join(self, worker: str) -> bool:
        """Record that ``worker``'s loop joined; False when it had joined before (a restart)."""
        return bool(self.r.hsetnx(self.p + "joined", worker, 1))

    def fail(self, worker: str, message: str) -> None:
        """Record the group's first failure (later ones are consequences: collective timeouts)."""
        self.r.set(self.p + "error", f"{worker}: {message}", nx=True)

    def error(self) -> str | None:
        raw = self.r.get(self.p + "error")
        return None if raw is None else raw.decode()
