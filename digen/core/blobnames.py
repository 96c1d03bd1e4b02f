"""Blob names: the one grammar of what a worker offers on the data plane, made and read here only.

A blob's name starts with its job (the data plane signs and checks a request with that job's
key: :func:`job_of`), then says what it holds::

    <job>:weights:<v>        weights version v: a trainer's whole copy, or one FSDP rank's shard
    <job>:state:<v>          a trainer's state at version v (weights, AdamW state, counters),
                             which a trainer that joins copies
    <job>:traj:<task id>     a generation task's trajectories (task id ``gen:<i>:<g>``)
    <job>:grad:<task id>     a train task's gradient (task id ``train:<i>:<g>[:<part>]``)

**Decision: the grammar lives in the pure core**, not in :mod:`digen.controlplane`: the data
plane reads a name's job and may not import the control plane, and the controller, the
workers and the benchmarks all make names; every one of them may import the core.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

WEIGHTS = "weights"
STATE = "state"
TRAJ = "traj"
GRAD = "grad"
VERSIONED = (WEIGHTS, STATE)
"""Kinds whose key is a weight version."""
PER_TASK = (TRAJ, GRAD)
"""Kinds whose key is the id of the task that made the blob."""


@dataclass(frozen=True)
class BlobName:
    """A parsed blob name: its job, its kind and its key (a version's digits or a task id)."""

    job: str
    kind: str
    key: str

    def __str__(self) -> str:
        return f"{self.job}:{self.kind}:{self.key}"

    @property
    def version(self) -> int:
        """The weight version of a ``weights`` or ``state`` blob (a ValueError for the others)."""
        if self.kind not in VERSIONED:
            raise ValueError(f"a {self.kind} blob has no version: {self}")
        return int(self.key)


def weights(job: str, version: int) -> str:
    """``<job>:weights:<v>``."""
    return str(BlobName(job, WEIGHTS, str(int(version))))


def state(job: str, version: int) -> str:
    """``<job>:state:<v>``."""
    return str(BlobName(job, STATE, str(int(version))))


def trajectories(job: str, task_id: str) -> str:
    """``<job>:traj:<task id>``: what generation task ``task_id`` made."""
    return str(BlobName(job, TRAJ, task_id))


def gradient(job: str, task_id: str) -> str:
    """``<job>:grad:<task id>``: what train task ``task_id`` made."""
    return str(BlobName(job, GRAD, task_id))


def job_of(name: str) -> str:
    """The job a blob belongs to: its name up to the first ``:``."""
    return name.split(":", 1)[0]


def parse(name: str) -> BlobName | None:
    """The parts of ``name``, or None when it is not a name of this grammar (an unknown kind, a
    version that is not a number, a part missing)."""
    job, sep1, rest = name.partition(":")
    kind, sep2, key = rest.partition(":")
    if not (job and sep1 and sep2 and key) or kind not in VERSIONED + PER_TASK:
        return None
    if kind in VERSIONED and not (key.isascii() and key.isdigit()):
        return None
    return BlobName(job, kind, key)


def of_job(names: Iterable[str], job: str, kind: str) -> list[BlobName]:
    """The parsed names among ``names`` of job ``job`` and kind ``kind``."""
    parsed = (parse(n) for n in names)
    return [b for b in parsed if b is not None and b.job == job and b.kind == kind]


def versions(names: Iterable[str], job: str) -> list[int]:
    """The weight versions ``names`` holds for ``job``, ascending."""
    return sorted(b.version for b in of_job(names, job, WEIGHTS))
