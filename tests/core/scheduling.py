"""What the pure Scheduler's tests share: a scheduler with a rollout and a trainer worker
joined, the tasks an answer released, and a task's completion event."""

from __future__ import annotations

from digen.core.events import Release, Role, TaskDone, TaskKind, TaskRef, WorkerJoined
from digen.core.scheduler import Scheduler, SchedulerConfig

GEN, TRAIN, EVAL, REWARD = TaskKind.GEN, TaskKind.TRAIN, TaskKind.EVAL, TaskKind.REWARD


def make(groups: int = 2, iterations: int = 2, **kw) -> Scheduler:
    """A Scheduler of ``groups`` groups a iteration, with ``r0`` (rollout, a100) and ``t0``
    (trainer, h100) joined; ``kw`` are further :class:`SchedulerConfig` fields."""
    s = Scheduler(SchedulerConfig(iterations=iterations, groups=groups, **kw))
    s.handle(WorkerJoined("r0", Role.ROLLOUT, "a100", 0.0), WorkerJoined("t0", Role.TRAINER, "h100", 0.0))
    return s


def releases(out: list, kind: TaskKind) -> list[tuple[int, int, int]]:
    """(iteration, group, version) of each ``kind`` task released in ``out``, in order."""
    return [
        (i.task.iteration, i.task.group, i.version)
        for i in out
        if isinstance(i, Release) and i.task.kind is kind
    ]


def done(
    kind: TaskKind, it: int, g: int, w: str = "r0", s: float = 0.0, e: float = 1.0, *, part=None
) -> TaskDone:
    """``w`` finished task ``kind`` of group ``g`` of iteration ``it`` (part ``part``), from ``s`` to ``e``."""
    return TaskDone(TaskRef(kind, it, g, part), w, s, e)
