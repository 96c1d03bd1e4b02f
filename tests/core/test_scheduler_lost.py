"""Lost data: a group whose trajectories died with their worker is generated again, train
tasks whose gradients died run again, and the step waits for them (pure scheduler)."""

from __future__ import annotations

from digen.core.events import (
    GroupLost,
    Release,
    Role,
    Step,
    StepDone,
    TaskDone,
    TaskRef,
    TrainLost,
    WorkerJoined,
)
from tests.core.scheduling import GEN, REWARD, TRAIN, done, make, releases


def trained(s, it, groups):
    out = []
    for g in groups:
        out += s.handle(TaskDone(TaskRef(TRAIN, it, g), "t0", 0.0, 1.0))
    return out


def test_a_lost_group_is_generated_again_with_its_version_and_its_rewards_stand():
    s = make(groups=2, gap=True)
    s.start(0.0)
    s.handle(done(GEN, 0, 0))
    out = s.handle(GroupLost(0, 0, 2.0))
    assert out == [Release(TaskRef(GEN, 0, 0), 0)]
    assert s.handle(GroupLost(0, 0, 2.5)) == []  # already being generated again
    again = s.handle(done(GEN, 0, 0, s=3.0, e=4.0))
    assert releases(again, TRAIN) == []  # its training was released when it was first scored
    assert releases(s.handle(done(GEN, 0, 1)), TRAIN) == [(0, 1, 0)]


def test_a_group_regenerated_after_scoring_is_not_scored_twice():
    s = make(groups=1)
    s.handle(WorkerJoined("s0", Role.REWARD, "cpu", 0.0))
    s.start(0.0)
    assert releases(s.handle(done(GEN, 0, 0)), REWARD) == [(0, 0, 0)]
    s.handle(TaskDone(TaskRef(REWARD, 0, 0), "s0", 1.0, 2.0))
    s.handle(GroupLost(0, 0, 3.0))
    assert releases(s.handle(done(GEN, 0, 0)), REWARD) == []  # its rewards are known


def test_a_group_of_a_stepped_iteration_is_never_regenerated():
    s = make(groups=1, iterations=3)
    s.start(0.0)
    s.handle(done(GEN, 0, 0))
    s.handle(TaskDone(TaskRef(TRAIN, 0, 0), "t0", 1.0, 2.0))
    s.handle(StepDone(0, 2.0, 3.0))
    assert s.handle(GroupLost(0, 0, 4.0)) == []


def test_lost_train_tasks_run_again_and_the_step_waits_for_them():
    s = make(groups=2, gap=True)
    s.start(0.0)
    s.handle(done(GEN, 0, 0), done(GEN, 0, 1))
    out = trained(s, 0, [0, 1])
    assert Step(0) in out
    again = s.handle(TrainLost(0, ((0, None),), 5.0))
    assert again == [Release(TaskRef(TRAIN, 0, 0), 0)]
    assert s.handle(TrainLost(0, ((0, None),), 5.5)) == []  # not done: nothing more to release
    assert Step(0) in trained(s, 0, [0])  # asked again once it is done again


def test_train_lost_of_another_iteration_is_ignored():
    s = make(groups=1, iterations=3)
    s.start(0.0)
    s.handle(done(GEN, 0, 0))
    trained(s, 0, [0])
    s.handle(StepDone(0, 1.0, 2.0))
    assert s.handle(TrainLost(0, ((0, None),), 3.0)) == []
