"""Task payloads: what the controller puts in a queue and a worker reads, one record per kind.

The controller's dispatcher (:mod:`digen.runtime.dispatch`), its step control
(:mod:`digen.runtime.steps`, :mod:`digen.runtime.fsdp_group`) and the held-out evaluation
(:mod:`digen.runtime.evals`) build these records; the workers (:mod:`digen.workers.tasks`,
:mod:`digen.workers.fsdp_loop`, :mod:`digen.workers.sp_loop`) read them back with :meth:`Payload.read`.
Every byte from Redis is untrusted: a payload that is not a dict of the right fields with
values of the right kinds raises :class:`~digen.errors.PayloadError` when it is read (the
task fails there, never deep inside the work). A payload is read as every message is, with
the one exact reading of :meth:`digen.controlplane.messages.Message.read` (no unknown key, no
value of another kind); where a group's trajectories are is a
:class:`~digen.controlplane.messages.BlobRef`, the record the results use for it too.

To add a task kind: a record here, its release in :mod:`digen.runtime.dispatch`, its run in
:mod:`digen.workers.tasks` (``RUNNERS``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from digen.controlplane.messages import BlobRef, Message
from digen.evaluation import EvalTask
from digen.records import Record
from digen.task_records import GroupTask, TrainSpec


class Payload(Message):
    """A task's payload: written with :meth:`to_json`, read back (checked) with :meth:`read`."""


@dataclass(frozen=True)
class GenPayload(Payload):
    """A generation task: the group to generate (its version inside), whether the worker scores
    it inline (else a reward task does), whether it keeps its images as grid cells."""

    task: GroupTask
    score: bool = True
    grid: bool = False


@dataclass(frozen=True)
class RewardPayload(Payload):
    """A reward task: the generated group to score, and where its decoded images are (None:
    being generated again; the task is re-posted with the new place)."""

    task: GroupTask
    source: BlobRef | None = None


@dataclass(frozen=True)
class TrainEntry(Record):
    """One further group of a batched train task (``train.groups_per_task``): its spec, its
    prompt and where its trajectories are."""

    spec: TrainSpec
    prompt: str
    source: BlobRef | None = None


@dataclass(frozen=True)
class TrainPayload(Payload):
    """A train task: its spec, the version it trains (:func:`digen.core.versions.version`), the
    group's prompt, whether TSP splits its timesteps, and where its trajectories are; a batched
    task (``train.groups_per_task``) carries its further groups in ``batch``, in group order.

    ``keep_gradient`` is where the gradient goes, decided by the controller from
    ``train.reduce`` (the worker never reads that key itself): True (``exact``), a blob that the
    step fetches and sums in task order, whoever trained it; False (``allreduce``), a trainer
    adds it into its own running sum (a rollout worker training under RAT keeps a blob either
    way, having no sum)."""

    spec: TrainSpec
    version: int
    prompt: str
    tsp: bool = False
    source: BlobRef | None = None
    batch: tuple[TrainEntry, ...] = ()
    keep_gradient: bool = False

    def entries(self) -> list[TrainEntry]:
        """Every group of the task, its first (the one that names it) first."""
        return [TrainEntry(self.spec, self.prompt, self.source), *self.batch]


@dataclass(frozen=True)
class EvalPayload(Payload):
    """An ``eval`` task: one chunk of held-out prompts and the version it scores."""

    task: EvalTask


@dataclass(frozen=True)
class StepPayload(Payload):
    """A step command's queue entry: which optimizer step it is. A replicated trainer group
    reads the rest from the command in Redis (:class:`~digen.controlplane.trainer_group.StepCommand`)."""

    iteration: int
    mini_batch: int


@dataclass(frozen=True)
class FsdpStepPayload(StepPayload):
    """An FSDP group's step command: its leader gets it all in the queue: whether the step ends
    the iteration, the rows to divide by (each rank checks its own count against them), the
    checkpoint folder after an iteration's last mini-batch, and the oldest version the ranks
    keep serving (None: only the newest)."""

    last_of_iteration: bool
    rows: int
    checkpoint: str | None
    keep_from: int | None


def with_sources(payload: Payload, sources: list[BlobRef | None]) -> Payload:
    """``payload`` with its groups' trajectories at ``sources`` (a re-posted reward or train
    task; one source per group, a batched train task's in group order)."""
    if isinstance(payload, RewardPayload):
        return replace(payload, source=sources[0])
    if isinstance(payload, TrainPayload):
        batch = tuple(replace(e, source=s) for e, s in zip(payload.batch, sources[1:], strict=True))
        return replace(payload, source=sources[0], batch=batch)
    return payload
