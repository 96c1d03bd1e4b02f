"""Per-job Redis state besides the task queue: role tags, weight versions, job status.

Keys (``P = digen:<job_id>:``)::

    P tag:<worker>     hash    role, budget (TAG/RAT off-role tasks), iteration (when it was set)
    P weights:<v>      string  safetensors of version v's trained tensors (LoRA adapter only
                               when LoRA), metadata {"version": v}
    P data:<task_id>   string  safetensors a task produced (trajectories, gradients)
    P status           string  running | cancel | done | failed
    P ready            hash    worker -> gpu type, for workers whose loop has loaded the model
    P loop:<worker>    string  token of the worker's current loop (one loop per worker)
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from digen.core.events import Role
from digen.runtime.codec import pack_tensors, unpack_tensors


@dataclass(frozen=True)
class LoopState:
    """A worker loop's view of the job at the top of a cycle (:meth:`JobState.loop_state`)."""

    status: str | None
    owns_loop: bool
    tag: tuple[Role, int] | None


class JobState:
    def __init__(self, redis_client, job_id: str):
        self.r = redis_client
        self.job_id = job_id
        self.p = f"digen:{job_id}:"

    # --- role tags --------------------------------------------------------------------
    def set_tag(self, worker: str, role: Role, budget: int) -> None:
        self.r.hset(self.p + f"tag:{worker}", mapping={"role": role.value, "budget": budget})

    def tag(self, worker: str) -> tuple[Role, int] | None:
        return _tag(self.r.hgetall(self.p + f"tag:{worker}"))

    def take_budget(self, worker: str) -> bool:
        """Spend one unit of the worker's off-role (TAG/RAT) budget; False (nothing spent) when none left."""
        left = self.r.hincrby(self.p + f"tag:{worker}", "budget", -1)
        if left < 0:
            self.r.hincrby(self.p + f"tag:{worker}", "budget", 1)
            return False
        return True

    def return_budget(self, worker: str) -> None:
        self.r.hincrby(self.p + f"tag:{worker}", "budget", 1)

    # --- weights ----------------------------------------------------------------------
    def publish(self, version: int, weights: dict[str, torch.Tensor]) -> int:
        """Store version ``version``; returns its size in bytes."""
        blob = pack_tensors(weights, {"version": str(version)})
        self.r.set(self.p + f"weights:{version}", blob)
        return len(blob)

    def weights(self, version: int) -> dict[str, torch.Tensor] | None:
        blob = self.r.get(self.p + f"weights:{version}")
        if blob is None:
            return None
        tensors, _ = unpack_tensors(blob)
        return tensors

    def has_weights(self, version: int) -> bool:
        return bool(self.r.exists(self.p + f"weights:{version}"))

    def drop_weights_before(self, version: int) -> None:
        for key in self.r.scan_iter(match=self.p + "weights:*", count=1000):
            if int(key.decode().rsplit(":", 1)[1]) < version:
                self.r.delete(key)

    # --- task data --------------------------------------------------------------------
    def put_data(
        self, task_id: str, tensors: dict[str, torch.Tensor], meta: dict[str, str] | None = None
    ) -> str:
        key = self.p + f"data:{task_id}"
        self.r.set(key, pack_tensors(tensors, meta))
        return key

    def data(self, task_id: str) -> dict[str, torch.Tensor] | None:
        blob = self.r.get(self.p + f"data:{task_id}")
        return None if blob is None else unpack_tensors(blob)[0]

    def drop_data(self, task_ids: list[str]) -> None:
        if task_ids:
            self.r.delete(*[self.p + f"data:{t}" for t in task_ids])

    # --- workers ----------------------------------------------------------------------
    def claim_loop(self, worker: str, token: str) -> None:
        """Make ``token`` the worker's current loop: an older loop on it stops at its next
        task boundary (a worker that seemed to leave and rejoin gets a second loop)."""
        self.r.set(self.p + f"loop:{worker}", token)

    def owns_loop(self, worker: str, token: str) -> bool:
        return _owns(self.r.get(self.p + f"loop:{worker}"), token)

    def loop_state(self, worker: str, token: str) -> LoopState:
        """What a worker loop reads before each task (the job's status, whether this loop is
        still the worker's, the worker's role tag), in one round trip."""
        pipe = self.r.pipeline(transaction=False)
        pipe.get(self.p + "status")
        pipe.get(self.p + f"loop:{worker}")
        pipe.hgetall(self.p + f"tag:{worker}")
        status, owner, tag = pipe.execute()
        return LoopState(None if status is None else status.decode(), _owns(owner, token), _tag(tag))

    def mark_ready(self, worker: str, gpu_type: str) -> None:
        self.r.hset(self.p + "ready", worker, gpu_type)

    def is_ready(self, worker: str) -> bool:
        return bool(self.r.hexists(self.p + "ready", worker))

    def note_startup(self, worker: str, times: dict[str, float]) -> None:
        """The worker's start-up times (wall clock; see :mod:`digen.startup`), as JSON."""
        self.r.hset(self.p + "startup", worker, json.dumps(times))

    def startup_notes(self) -> dict[str, dict[str, float]]:
        raw = self.r.hgetall(self.p + "startup")
        return {k.decode(): json.loads(v) for k, v in raw.items()}

    # --- status -----------------------------------------------------------------------
    def set_status(self, status: str) -> None:
        self.r.set(self.p + "status", status)

    def status(self) -> str | None:
        s = self.r.get(self.p + "status")
        return None if s is None else s.decode()


def _tag(raw: dict) -> tuple[Role, int] | None:
    if not raw:
        return None
    return Role(raw[b"role"].decode()), int(raw.get(b"budget", b"0"))


def _owns(raw: bytes | None, token: str) -> bool:
    return raw is None or raw.decode() == token
