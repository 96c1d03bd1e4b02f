"""The pure Scheduler with train tasks of several groups (``train.groups_per_task``)."""

from __future__ import annotations

import pytest

from digen.core.events import (
    Finish,
    Release,
    SetRole,
    Step,
    StepDone,
    TrainLost,
)
from digen.core.scheduler import Scheduler, SchedulerConfig, task_groups
from tests.core import scheduling
from tests.core.scheduling import GEN, TRAIN, done


def make(groups=6, iterations=1, **kw) -> Scheduler:
    return scheduling.make(groups, iterations, **kw)


def trains(out) -> list[tuple[int, int, int | None]]:
    return [
        (i.task.iteration, i.task.group, i.task.part)
        for i in out
        if isinstance(i, Release) and i.task.kind is TRAIN
    ]


def test_a_task_is_a_run_of_consecutive_groups_of_its_mini_batch_the_last_taking_what_is_left():
    runs = lambda n, m=1, p=7, s=False: sorted({tuple(task_groups(g, p, m, n, s)) for g in range(p)})  # noqa: E731
    assert runs(1) == [(g,) for g in range(7)]
    assert runs(3) == [(0, 1, 2), (3, 4, 5), (6,)]
    assert runs(10) == [tuple(range(7))]
    # two mini-batches of 4 groups: a task never crosses a mini-batch
    assert runs(3, m=2, p=8) == [(0, 1, 2), (3,), (4, 5, 6), (7,)]
    # the samples split: every task has a share of each mini-batch, runs over the iteration
    assert runs(3, m=2, p=8, s=True) == [(0, 1, 2), (3, 4, 5), (6, 7)]


def test_gap_releases_a_batched_task_once_its_own_groups_are_scored_and_steps_on_all_tasks():
    s = make(gap=True, groups_per_task=2, groups=5)
    s.start(0.0)
    assert trains(s.handle(done(GEN, 0, 1))) == []  # its task's group 0 is not scored yet
    assert trains(s.handle(done(GEN, 0, 3))) == []
    assert trains(s.handle(done(GEN, 0, 0))) == [(0, 0, None)]  # groups 0+1: one task, named 0
    assert trains(s.handle(done(GEN, 0, 2))) == [(0, 2, None)]  # groups 2+3, not waiting for 4
    assert s.handle(done(TRAIN, 0, 0, "t0")) == []
    assert s.handle(done(TRAIN, 0, 2, "t0")) == []
    assert trains(s.handle(done(GEN, 0, 4))) == [(0, 4, None)]  # the last task takes what is left
    assert s.handle(done(TRAIN, 0, 4, "t0")) == [Step(0)]
    assert s.handle(StepDone(0, 1.0, 1.1)) == [Finish()]


def test_without_gap_a_batched_iteration_releases_its_tasks_once_it_is_scored():
    s = make(groups_per_task=4, groups=6)
    s.start(0.0)
    for g in range(5):
        assert trains(s.handle(done(GEN, 0, g))) == []
    assert trains(s.handle(done(GEN, 0, 5))) == [(0, 0, None), (0, 4, None)]


def test_mini_batches_split_samples_release_one_task_per_run_and_mini_batch():
    s = make(groups=4, mini_batches=2, split_samples=True, groups_per_task=2, gap=True)
    s.start(0.0)
    out = s.handle(*[done(GEN, 0, g) for g in range(4)])
    assert trains(out) == [(0, 0, 0), (0, 2, 0)]
    s.handle(done(TRAIN, 0, 0, "t0", part=0))
    assert s.handle(done(TRAIN, 0, 2, "t0", part=0)) == [Step(0, 0)]
    assert trains(s.handle(StepDone(0, 1.0, 1.1, mini_batch=0))) == [(0, 0, 1), (0, 2, 1)]


def test_a_lost_batched_task_is_released_again_whole():
    s = make(groups=4, groups_per_task=2, gap=True)
    s.start(0.0)
    s.handle(*[done(GEN, 0, g) for g in range(4)])
    s.handle(done(TRAIN, 0, 0, "t0"))
    assert s.handle(done(TRAIN, 0, 2, "t0")) == [Step(0)]
    assert trains(s.handle(TrainLost(0, ((2, None),), 2.0))) == [(0, 2, None)]
    assert s.handle(done(TRAIN, 0, 2, "t0")) == [Step(0)]


def test_a_batched_task_teaches_seconds_per_group_and_is_never_split_for_rat():
    pinned = {GEN: 1.0, TRAIN: 8.0}  # training-bound: RAT pays
    one = make(groups=8, iterations=3, rat=True, gap=True, task_seconds=pinned)
    two = make(groups=8, iterations=3, rat=True, gap=True, task_seconds=pinned, groups_per_task=2)
    for s in (one, two):
        s.start(0.0)
        s.handle(*[done(GEN, 0, g) for g in range(8)])
        s.handle(*[done(TRAIN, 0, g, "t0") for g in range(0, 8, s.cfg.groups_per_task)])
    roles_one = one.handle(StepDone(0, 1.0, 1.1))
    roles_two = two.handle(StepDone(0, 1.0, 1.1))
    budget = lambda out: {i.worker: i.budget for i in out if isinstance(i, SetRole)}  # noqa: E731
    assert budget(roles_one)["r0"] > 0 and one.splits[1] > 0  # halves at 1 group per task
    assert 1 not in two.splits  # never at 2
    assert budget(roles_two)["r0"] == budget(roles_one)["r0"] // 2 // 2  # halves -> groups -> tasks
    two.handle(*[done(GEN, 1, g) for g in range(8)])
    assert all(i.task.part is None for i in two.handle() if isinstance(i, Release))


@pytest.mark.parametrize("kw", [{}, {"gap": True}, {"gap": True, "mini_batches": 2}, {"split_samples": True}])
def test_one_group_per_task_is_the_unbatched_schedule(kw):
    a, b = make(groups=4, **kw), make(groups=4, groups_per_task=1, **kw)
    assert a.start(0.0) == b.start(0.0)
    events = [done(GEN, 0, g) for g in (2, 0, 3, 1)]
    assert [a.handle(e) for e in events] == [b.handle(e) for e in events]


def test_groups_per_task_must_be_positive():
    with pytest.raises(ValueError, match="groups_per_task"):
        Scheduler(SchedulerConfig(iterations=1, groups=4, groups_per_task=0))
