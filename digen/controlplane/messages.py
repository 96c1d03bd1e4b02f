"""What the workers send back: one record per result, and where a blob is.

The other direction, what the controller sends (task payloads), is
:mod:`~digen.controlplane.payloads`; this is a module of its own because its records are
written by the workers and read by the controller (:mod:`digen.runtime.results`,
:mod:`~digen.runtime.evals`, :mod:`~digen.runtime.steps`, :mod:`~digen.runtime.fsdp_group`),
while a payload goes the other way. :class:`BlobRef` travels both ways (a result says where
its output is, a payload or a step command where a task's input is), so the payloads and the
step command (:class:`~digen.controlplane.trainer_group.StepCommand`) import it from here;
the timeline row a result carries is :class:`~digen.core.timeline.TimelineRow`, in the pure
core, because the reference loop and the simulator make rows too.

One codec for every message: a record is written with :meth:`~digen.records.Record.to_json`
(plain data, which the queue packs with msgpack, :mod:`digen.controlplane.codec`; the step
command goes to ``tg:step`` as JSON) and read back with :meth:`Message.read`, which takes the
queue's decoded value or raw bytes and reads it with
:meth:`~digen.records.Record.read_exact`: no conversion, no unknown key, no missing one, no
value of another kind, nothing past the size limits (:data:`MAX_MESSAGE_BYTES` for the bytes,
:data:`~digen.records.MAX_TEXT`, :data:`~digen.records.MAX_BYTES`,
:data:`~digen.records.MAX_ITEMS` inside). What does not read raises
:class:`~digen.errors.PayloadError` naming the message and the fault; the controller
quarantines such a result as junk (:meth:`~digen.controlplane.queue.TaskQueue.quarantine`:
recorded, counted) and runs its task again, never a ``KeyError`` of its own. A step's
acknowledgement that does not read is quarantined too and asked for again, not run again (the
trainers applied the step already; a second run would step twice): the step's writer, or the
FSDP leader, acknowledges it again from what it holds
(:meth:`~digen.runtime.steps.StepGroup.ask_again`), up to ``schedule.max_attempts`` times.

Every result has the same envelope (:class:`Result`): the worker that ran it, that worker
loop's incarnation (a result of a process that is gone does not count), when it started and
ended (the worker's clock) and its timeline rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Self

from digen.controlplane.codec import unpack
from digen.controlplane.queue import is_step_id
from digen.core.events import TaskKind, TaskRef
from digen.core.timeline import TimelineRow
from digen.errors import PayloadError
from digen.records import MAX_BYTES, Record
from digen.task_records import TrainStats

MAX_MESSAGE_BYTES = MAX_BYTES + (16 << 20)
"""The most bytes a message read from raw bytes may have (its grid cells and the rest)."""
PNG = b"\x89PNG\r\n\x1a\n"
"""How grid cells begin (:func:`digen.viz.to_png`)."""


def _png(cells: bytes | None, what: str) -> None:
    if cells is not None and not cells.startswith(PNG):
        raise ValueError(f"{what}.cells: not a PNG image ({len(cells)} bytes)")


class Message(Record):
    """A record that travels through Redis: written with :meth:`to_json`, read back exactly
    with :meth:`read`."""

    @classmethod
    def read(cls, raw: object) -> Self:
        """The message in ``raw`` (the queue's decoded value, or msgpack bytes);
        :class:`PayloadError` naming the message and the fault when it is not one."""
        if isinstance(raw, bytes | bytearray | memoryview):
            if len(raw) > MAX_MESSAGE_BYTES:
                raise PayloadError(
                    f"a {cls.__name__} of {len(raw)} bytes, more than the limit of {MAX_MESSAGE_BYTES}"
                )
            raw = unpack(bytes(raw))
        try:
            return cls.read_exact(raw)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise PayloadError(f"a {cls.__name__} that does not read: {exc}") from None


@dataclass(frozen=True)
class BlobRef(Message):
    """Where a blob is: its server's address and its name; the digest its maker published and
    the weights version it was made with (what a consumer checks it against:
    :mod:`digen.dataplane.blobs`; "" and None: unknown), and the worker that holds it ("":
    not said, as in a payload, where the worker fetches by address)."""

    addr: str
    name: str
    digest: str = ""
    version: int | None = None
    worker: str = ""
    nbytes: int | None = None
    """Its size (a generated group's trajectories)."""


@dataclass(frozen=True)
class TaskBlob(Message):
    """A train task's gradient kept as a blob (a row of a step command's ``blobs``)."""

    task: str
    blob: BlobRef


@dataclass(kw_only=True)
class Result(Message):
    """The envelope every result carries (see the module docstring)."""

    worker: str
    start: float
    end: float
    events: list[TimelineRow] = field(default_factory=list)
    incarnation: str = ""


@dataclass(kw_only=True)
class GenResult(Result):
    """A generation task's: its group's rewards (empty when a ``reward`` task scores it),
    where its trajectories are, its per-reward parts (``train.multi_reward`` per_reward or
    gdpo) and, for a sample grid, its images as grid cells (PNG)."""

    blob: BlobRef
    rewards: list[float] = field(default_factory=list)
    reward_parts: list[list[float]] | None = None
    cells: bytes | None = None

    def __post_init__(self) -> None:
        _png(self.cells, "GenResult")


@dataclass(kw_only=True)
class RewardResult(Result):
    """A ``reward`` task's: its group's rewards and per-reward parts."""

    rewards: list[float] = field(default_factory=list)
    reward_parts: list[list[float]] | None = None


@dataclass(kw_only=True)
class TrainResult(Result):
    """A train task's: its stats and, when its gradient is kept as a blob (``train.reduce:
    exact``, or a worker outside the trainer group), where it is (None: in the member's sum)."""

    stats: TrainStats
    grad: BlobRef | None = None


@dataclass(kw_only=True)
class EvalChunkResult(Result):
    """An ``eval`` task's: its prompts' scores per reward component and their images as grid
    cells (PNG)."""

    scores: dict[str, list[float]]
    cells: bytes

    def __post_init__(self) -> None:
        _png(self.cells, "EvalChunkResult")


@dataclass(kw_only=True)
class StepAck(Result):
    """An optimizer step's acknowledgement (the trainer group's writer, or an FSDP group's
    leader): the gradient norm, the version now served, the checkpoint staged (None: none)."""

    grad_norm: float
    version: int
    checkpoint: str | None = None


RESULTS: dict[TaskKind, type[Result]] = {
    TaskKind.GEN: GenResult,
    TaskKind.REWARD: RewardResult,
    TaskKind.TRAIN: TrainResult,
    TaskKind.EVAL: EvalChunkResult,
}
"""A task kind -> the result its task acknowledges (a step's: :class:`StepAck`)."""


def result_type(task_id: str) -> type[Result]:
    """The record the result of task ``task_id`` is (a valid task or step id: the queue
    hands the controller no other)."""
    return StepAck if is_step_id(task_id) else RESULTS[TaskRef.parse(task_id).kind]
