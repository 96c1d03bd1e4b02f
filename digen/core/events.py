"""Events into the :class:`~digen.core.scheduler.Scheduler` and instructions out of it.

Plain frozen dataclasses: no I/O, no clock (times arrive on events as floats, in seconds),
no randomness. The runtime controller builds events from Redis and Dask; the simulator
builds them from a cost model.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class TaskKind(str, Enum):
    GEN = "gen"
    TRAIN = "train"
    REWARD = "reward"
    """Score a generated group (only when reward workers exist, see :class:`Role`)."""
    EVAL = "eval"
    """Sample and score a chunk of held-out prompts with the ODE sampler (``eval.*``)."""


class Role(str, Enum):
    ROLLOUT = "rollout"
    TRAINER = "trainer"
    COLOCATED = "colocated"
    REWARD = "reward"
    """Only scores: takes ``reward`` tasks (a big reward model on its own GPU type)."""


@dataclass(frozen=True)
class TaskRef:
    """One task: a prompt group of an iteration, to generate, score or train (for ``eval``:
    a chunk of test prompts, evaluating the version after ``iteration``). ``part``: a train
    task split in two halves of the group's samples (0 or 1; None: the whole group), which
    the scheduler does for the last groups of an iteration when an idle rollout worker
    should take half a group's training (RAT at half-group granularity); with
    ``train.mini_batch_split: samples``, the mini-batch whose samples of the group the task
    trains (0 .. M-1). With ``train.groups_per_task`` n > 1 a train task's ``group`` is the
    first of the n consecutive groups it carries (:func:`digen.core.scheduler.task_groups`);
    the id grammar is the same."""

    kind: TaskKind
    iteration: int
    group: int
    part: int | None = None

    @property
    def id(self) -> str:
        base = f"{self.kind.value}:{self.iteration}:{self.group}"
        return base if self.part is None else f"{base}:{self.part}"

    @property
    def share(self) -> float:
        """The fraction of its group's work this task is."""
        return 1.0 if self.part is None else 0.5

    @staticmethod
    def parse(task_id: str) -> TaskRef:
        """``"gen:3:1"`` -> ``TaskRef(GEN, 3, 1)``; a ValueError naming the text when it is not
        a task id (``kind:iteration:group[:part]``)."""
        try:
            kind, it, g, *part = task_id.split(":")
            if len(part) > 1:
                raise ValueError
            return TaskRef(TaskKind(kind), int(it), int(g), int(part[0]) if part else None)
        except (ValueError, TypeError, AttributeError):
            raise ValueError(f"{task_id!r} is not a task id (kind:iteration:group[:part])") from None


def work_share(ref: TaskRef, groups: int, mini_batches: int, split_samples: bool) -> float:
    """The groups' work task ``ref`` is, in whole groups: what TAG and RAT learn seconds per
    group from and the bench counts. A generation or reward task is its group's
    (:attr:`TaskRef.share`); a train task of ``groups`` groups is its share of each, or with
    ``train.mini_batch_split: samples`` 1/``mini_batches`` of each. Decided here for the
    scheduler and the workers alike."""
    if ref.kind is not TaskKind.TRAIN:
        return ref.share
    return groups / mini_batches if split_samples else groups * ref.share


# --- events ---------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerJoined:
    worker: str
    role: Role
    gpu_type: str
    t: float


@dataclass(frozen=True)
class WorkerLeft:
    worker: str
    t: float


@dataclass(frozen=True)
class TaskDone:
    """A task finished on ``worker``: it ran from ``start`` to ``end``."""

    task: TaskRef
    worker: str
    start: float
    end: float


@dataclass(frozen=True)
class TaskLost:
    """A task whose lease expired or whose worker died: it is back in its queue."""

    task: TaskRef
    t: float


@dataclass(frozen=True)
class GroupLost:
    """A generated group's trajectories are gone (the worker that held them died) while its
    training still needs them: generate it again. Same version, same per-sample seeds: the
    same trajectories and rewards (at-least-once delivery, exactly-once effect)."""

    iteration: int
    group: int
    t: float


@dataclass(frozen=True)
class TrainLost:
    """Train tasks whose gradients are gone before the optimizer step counted them (the
    trainer that held them died, or the step's commit was aborted): train them again. A step
    of their iteration that was asked for is void; the scheduler asks again once they are done."""

    iteration: int
    tasks: tuple[tuple[int, int | None], ...]
    """(group, part) of each lost train task."""
    t: float


@dataclass(frozen=True)
class StepDone:
    """The optimizer step of ``iteration``'s mini-batch ``mini_batch`` finished and the next
    version (``iteration * mini_batches + mini_batch + 1``) is published."""

    iteration: int
    start: float
    end: float
    mini_batch: int = 0


Event = WorkerJoined | WorkerLeft | TaskDone | TaskLost | GroupLost | TrainLost | StepDone


# --- instructions ---------------------------------------------------------------------


@dataclass(frozen=True)
class Release:
    """Put ``task`` in its queue; a generation task runs with weights ``version``."""

    task: TaskRef
    version: int


@dataclass(frozen=True)
class SetRole:
    """Tag ``worker`` with ``role``. ``budget``: off-role tasks it may take this iteration
    when none of its own kind is ready: generation tasks for a trainer (TAG), train tasks
    for a rollout worker (RAT)."""

    worker: str
    role: Role
    budget: int = 0


@dataclass(frozen=True)
class Step:
    """Every train task of ``iteration``'s mini-batch ``mini_batch`` is done (with one
    mini-batch: of the iteration): sum their gradients, step, publish the next version, then
    report :class:`StepDone` with the same ``mini_batch``."""

    iteration: int
    mini_batch: int = 0


@dataclass(frozen=True)
class RequeueWorker:
    """``worker`` left: put its leased tasks back in their queues."""

    worker: str


@dataclass(frozen=True)
class Finish:
    """The last iteration's step is done."""


Instruction = Release | SetRole | Step | RequeueWorker | Finish
