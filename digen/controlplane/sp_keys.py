"""The sequence-parallel replicas' keys in Redis (``rollout.sequence_parallel: d``): what
their ranks (:mod:`digen.workers.sp_loop`) and the controller (:mod:`digen.runtime.sp_group`) both
read.

Keys (``P = digen:<job_id>:``, cleared with the job's other keys)::

    P sp:plan           string  JSON {"degree": d, "replicas": [[leader, follower, ...], ...]}
    P sp:store:<leader> string  JSON {"host", "store", "backend"}: the leader's formation
    P sp:joined         hash    worker -> 1 once its loop joined (a second join is a restart)
    P sp:solo           hash    worker -> why it left its replica (it runs d=1 from then on)
"""

from __future__ import annotations

from digen.controlplane.jsonkeys import JsonKeys, Rendezvous


class SpGroup(JsonKeys):
    """The replicas' rendezvous and membership keys in Redis (JSON only)."""

    def __init__(self, redis_client, job_id: str):
        super().__init__(redis_client, job_id, "sp")

    def set_plan(self, degree: int, replicas: list[list[str]]) -> None:
        self.set_json("plan", {"degree": degree, "replicas": replicas})

    def plan(self) -> dict | None:
        return self.get_json("plan")

    def rendezvous(self, leader: str) -> Rendezvous:
        """``leader``'s replica's rendezvous, gone once the leader left its replica (it restarted)."""
        return Rendezvous(
            self, f"store:{leader}", "the replica's rendezvous", lambda: self.solo().get(leader)
        )

    def join(self, worker: str) -> bool:
        """Record that ``worker``'s loop joined; False when it had joined before (a restart)."""
        return bool(self.r.hsetnx(self.p + "joined", worker, 1))

    def leave(self, worker: str, why: str) -> None:
        """``worker`` left its replica (or never formed it) and runs as a d=1 worker."""
        self.r.hsetnx(self.p + "solo", worker, why)

    def solo(self) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in self.r.hgetall(self.p + "solo").items()}
