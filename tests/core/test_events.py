"""The work a task is, one rule for the scheduler and the workers (digen/core/events.py)."""

from __future__ import annotations

from digen.core.events import TaskKind, TaskRef, work_share


def test_work_share_of_each_task_shape():
    assert work_share(TaskRef(TaskKind.GEN, 1, 0), 1, 4, False) == 1.0
    assert work_share(TaskRef(TaskKind.TRAIN, 1, 0), 1, 4, False) == 1.0  # one whole group
    assert work_share(TaskRef(TaskKind.TRAIN, 1, 0, 1), 1, 4, False) == 0.5  # a TSP half
    assert work_share(TaskRef(TaskKind.TRAIN, 1, 0), 3, 4, False) == 3.0  # train.groups_per_task 3
    assert work_share(TaskRef(TaskKind.TRAIN, 1, 0, 2), 2, 4, True) == 0.5  # samples split: 1/M of each
