"""Per-job Redis state besides the task queue: role tags, job status, what workers need to
know at start. No tensor: those go worker to worker (:mod:`digen.dataplane`), and the trainer
group's keys are :mod:`digen.controlplane.trainer_group`'s.

Keys (``P = digen:<job_id>:``)::

    P tag:<worker>     hash    role, budget (TAG/RAT off-role tasks), iteration (when it was set)
    P status           string  running | cancel | done | failed
    P ready            hash    worker -> gpu type, for workers whose loop has loaded the model
    P loop:<worker>    string  token of the worker's current loop (one loop per worker): its
                               *incarnation*, chosen by the controller that placed the loop. A
                               restarted worker keeps its name and gets a new loop and token,
                               so the trainer group counts it as a new member (a step command
                               names each member's incarnation)
    P stepped          string  the newest iteration whose optimizer step is done: workers drop
                               the trajectories and gradients of it and older ones
    P blobkey          string  the job's blob key (hex, 32 bytes): every blob request of the job
                               is signed with it (:mod:`digen.dataplane.auth`)
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

from digen.core.events import Role

BLOB_KEY_BYTES = 32
"""The job's blob key (HMAC-SHA256, :mod:`digen.dataplane.auth`: the same size there)."""


@dataclass(frozen=True)
class LoopState:
    """A worker loop's view of the job at the top of a cycle (:meth:`JobState.loop_state`)."""

    status: str | None
    owns_loop: bool
    tag: tuple[Role, int] | None
    step: bytes | None = None
    """The mark of the trainer group's newest step command (:attr:`StepCommand.mark`)."""
    stepped: int = -1
    """The newest iteration whose step is done."""


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

    # --- progress ---------------------------------------------------------------
    def set_stepped(self, iteration: int) -> None:
        self.r.set(self.p + "stepped", iteration)

    # --- workers ----------------------------------------------------------------------
    def claim_loop(self, worker: str, token: str) -> None:
        """Make ``token`` the worker's current loop: an older loop on it stops at its next
        task boundary (a worker that seemed to leave and rejoin gets a second loop). The
        worker is not ready again until this loop has loaded its model (a restarted trainer
        is no member before it holds the state)."""
        pipe = self.r.pipeline(transaction=True)
        pipe.set(self.p + f"loop:{worker}", token)
        pipe.hdel(self.p + "ready", worker)
        pipe.execute()

    def incarnations(self, workers: list[str]) -> dict[str, str]:
        """worker -> the token of its current loop (its incarnation), for those that have one."""
        if not workers:
            return {}
        raw = self.r.mget([self.p + f"loop:{w}" for w in workers])
        return {w: v.decode() for w, v in zip(workers, raw, strict=True) if v is not None}

    def owns_loop(self, worker: str, token: str) -> bool:
        return _owns(self.r.get(self.p + f"loop:{worker}"), token)

    def loop_state(self, worker: str, token: str) -> LoopState:
        """What a worker loop reads before each task (the job's status, whether this loop is
        still the worker's, the worker's role tag, the trainer group's newest step command and
        the newest stepped iteration), in one round trip."""
        pipe = self.r.pipeline(transaction=False)
        pipe.get(self.p + "status")
        pipe.get(self.p + f"loop:{worker}")
        pipe.hgetall(self.p + f"tag:{worker}")
        pipe.get(self.p + "tg:step:mark")
        pipe.get(self.p + "stepped")
        status, owner, tag, step, stepped = pipe.execute()
        return LoopState(
            None if status is None else status.decode(),
            _owns(owner, token),
            _tag(tag),
            step,
            -1 if stepped is None else int(stepped),
        )

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

    # --- the data plane's key ----------------------------------------------------------
    def blob_key(self) -> bytes:
        """The job's blob key: made by the first to ask (the controller, when the job starts;
        ``SET NX``, so two askers get the same key) and read by every worker's loop. Only the
        job's processes can read the job's Redis: only they can sign a blob request."""
        self.r.set(self.p + "blobkey", secrets.token_hex(BLOB_KEY_BYTES), nx=True)
        raw = self.r.get(self.p + "blobkey")
        key = bytes.fromhex(raw.decode()) if raw is not None else b""
        if len(key) != BLOB_KEY_BYTES:
            raise ValueError(f"job {self.job_id}'s blob key in Redis is not {BLOB_KEY_BYTES} bytes")
        return key

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
