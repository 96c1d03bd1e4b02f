"""The pure Scheduler with several optimizer steps per iteration (``train.mini_batches``)."""

from __future__ import annotations

import pytest

from digen.core.events import (
    Finish,
    Release,
    Role,
    SetRole,
    Step,
    StepDone,
    TaskDone,
    TaskRef,
)
from digen.core.scheduler import Scheduler, SchedulerConfig, mini_batch_of
from tests.core import scheduling
from tests.core.scheduling import EVAL, GEN, TRAIN, done, releases


def make(groups=4, iterations=2, mini_batches=2, **kw) -> Scheduler:
    return scheduling.make(groups, iterations, mini_batches=mini_batches, **kw)


def test_groups_split_into_consecutive_equal_mini_batches():
    assert [mini_batch_of(g, 6, 3) for g in range(6)] == [0, 0, 1, 1, 2, 2]
    assert [mini_batch_of(g, 4, 1) for g in range(4)] == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="mini_batches \\(3\\) must be >= 1 and divide groups \\(4\\)"):
        Scheduler(SchedulerConfig(iterations=1, groups=4, mini_batches=3))


def test_gap_steps_the_first_mini_batch_before_the_last_group_is_generated():
    s = make(gap=True)
    assert releases(s.start(0.0), GEN) == [(0, g, 0) for g in range(4)]
    assert releases(s.handle(done(GEN, 0, 0)), TRAIN) == [(0, 0, 0)]
    # group 2 is mini-batch 1: it waits for version 1 even though it is scored
    assert releases(s.handle(done(GEN, 0, 2)), TRAIN) == []
    assert releases(s.handle(done(GEN, 0, 1)), TRAIN) == [(0, 1, 0)]
    assert s.handle(done(TRAIN, 0, 0, "t0")) == []
    # mini-batch 0 is trained while group 3 still generates: it steps now
    assert s.handle(done(TRAIN, 0, 1, "t0")) == [Step(0, 0)]
    assert s.published == 0
    out = s.handle(StepDone(0, 1.0, 1.1, mini_batch=0))
    assert s.published == 1
    assert releases(out, TRAIN) == [(0, 2, 1)]  # the scored group of mini-batch 1, at version 1
    assert releases(s.handle(done(GEN, 0, 3)), TRAIN) == [(0, 3, 1)]
    s.handle(done(TRAIN, 0, 2, "t0"))
    assert s.handle(done(TRAIN, 0, 3, "t0")) == [Step(0, 1)]
    out = s.handle(StepDone(0, 2.0, 2.1, mini_batch=1))
    # the iteration is done: the next one generates with version 2 = M * 1
    assert releases(out, GEN) == [(1, g, 2) for g in range(4)]


def test_without_gap_every_mini_batch_waits_for_the_whole_iteration():
    s = make(gap=False)
    s.start(0.0)
    for g in (0, 1, 2):
        assert releases(s.handle(done(GEN, 0, g)), TRAIN) == []
    assert releases(s.handle(done(GEN, 0, 3)), TRAIN) == [(0, 0, 0), (0, 1, 0)]


def test_versions_count_steps_and_staleness_counts_iterations():
    """M = 2, staleness 1: iteration i generates with version 2 (i - 1), its mini-batch m
    trains version 2 i + m; a trajectory lags at most M s + M - 1 = 3 versions."""
    s = make(gap=True, max_staleness=1, iterations=4, groups=2)
    pending = s.start(0.0)
    gen_version, lags, t = {}, [], 0.0
    while not any(isinstance(i, Finish) for i in pending):
        new = []
        for ins in pending:
            if isinstance(ins, Release) and ins.task.kind is GEN:
                gen_version[ins.task.iteration] = ins.version
                new += s.handle(done(GEN, ins.task.iteration, ins.task.group))
            elif isinstance(ins, Release) and ins.task.kind is TRAIN:
                k, g = ins.task.iteration, ins.task.group
                assert ins.version == 2 * k + mini_batch_of(g, 2, 2)
                lags.append(ins.version - gen_version[k])
                new += s.handle(done(TRAIN, k, g, "t0"))
            elif isinstance(ins, Step):
                new += s.handle(StepDone(ins.iteration, t, t + 0.1, mini_batch=ins.mini_batch))
        pending, t = new, t + 1
    assert gen_version == {0: 0, 1: 0, 2: 2, 3: 4}
    assert sorted(set(lags)) == [0, 1, 2, 3] and max(lags) == 2 * 1 + 2 - 1


def test_staleness_zero_trains_in_the_reference_order():
    """s = 0: every generation of iteration k uses version M k, mini-batch m trains M k + m
    (digen/reference.py's loop)."""
    s = make(gap=True, iterations=2, groups=4, mini_batches=4)
    out = s.start(0.0)
    assert releases(out, GEN) == [(0, g, 0) for g in range(4)]
    for g in range(4):
        s.handle(done(GEN, 0, g))
    for m in range(4):
        assert s.handle(done(TRAIN, 0, m, "t0")) == [Step(0, m)]
        out = s.handle(StepDone(0, 0.0, 1.0, mini_batch=m))
        assert releases(out, TRAIN) == ([(0, m + 1, m + 1)] if m < 3 else [])
    assert releases(out, GEN) == [(1, g, 4) for g in range(4)]


def test_step_done_out_of_order_is_refused():
    s = make(gap=True, groups=2)
    s.start(0.0)
    s.handle(done(GEN, 0, 0), done(GEN, 0, 1))
    assert s.handle(done(TRAIN, 0, 0, "t0")) == [Step(0, 0)]
    with pytest.raises(
        ValueError, match="iteration 0 mini-batch 1 reported, expected iteration 0 mini-batch 0"
    ):
        s.handle(StepDone(0, 0.0, 1.0, mini_batch=1))


def test_rat_halves_of_the_last_groups_count_in_their_mini_batch():
    s = make(gap=True, rat=True, groups=4, iterations=3)
    s.start(0.0)
    for g in range(4):
        s.handle(TaskDone(TaskRef(GEN, 0, g), "r0", 0.0, 1.0))  # generation: 1 s per group
    for m in range(2):
        for g in (2 * m, 2 * m + 1):
            s.handle(TaskDone(TaskRef(TRAIN, 0, g), "t0", 0.0, 3.0))  # training: 3 s per group
        out = s.handle(StepDone(0, 0.0, 1.0, mini_batch=m))
    # 3 halves to the rollout worker: max(3 (4 - 1.5), 4 + 1.5 * 3) = 8.5 s < 12 s
    assert SetRole("r0", Role.ROLLOUT, 3) in out
    released = []
    for g in range(4):
        released += [i for i in s.handle(done(GEN, 1, g)) if isinstance(i, Release)]
    trains = [(i.task.group, i.task.part, i.version) for i in released if i.task.kind is TRAIN]
    # the last 3 groups train as halves: group 1 in mini-batch 0 (version 2), 2 and 3 wait
    assert trains == [(0, None, 2), (1, 0, 2), (1, 1, 2)]
    assert s.handle(done(TRAIN, 1, 0, "t0"), done(TRAIN, 1, 1, "t0", part=0)) == []
    assert s.handle(done(TRAIN, 1, 1, "r0", part=1)) == [Step(1, 0)]
    out = s.handle(StepDone(1, 0.0, 1.0, mini_batch=0))
    halves = [(i.task.group, i.task.part, i.version) for i in out if isinstance(i, Release)]
    assert halves == [(2, 0, 3), (2, 1, 3), (3, 0, 3), (3, 1, 3)]
    steps = [i for g, p, _ in halves for i in s.handle(done(TRAIN, 1, g, "t0", part=p))]
    assert steps == [Step(1, 1)]


def test_evaluation_uses_the_iteration_s_last_version():
    s = make(gap=True, groups=2, iterations=1, eval_every=1, eval_tasks=1)
    s.start(0.0)
    s.handle(done(GEN, 0, 0), done(GEN, 0, 1))
    s.handle(done(TRAIN, 0, 0, "t0"))
    s.handle(StepDone(0, 0.0, 1.0, mini_batch=0))
    s.handle(done(TRAIN, 0, 1, "t0"))
    out = s.handle(StepDone(0, 1.0, 2.0, mini_batch=1))
    assert releases(out, EVAL) == [(0, 0, 2)]
    assert s.handle(done(EVAL, 0, 0)) == [Finish()]


def parts(out):
    return [
        (i.task.group, i.task.part, i.version) for i in out if isinstance(i, Release) and i.task.kind is TRAIN
    ]


def test_samples_split_waits_for_every_group_even_with_gap():
    """``split_samples`` (Flow-GRPO's split): mini-batch m is one task per group (part m),
    released only when the whole iteration is scored, even in GAP with group-local advantages."""
    s = make(gap=True, groups=3, split_samples=True)  # 3 groups, 2 mini-batches: need not divide
    s.start(0.0)
    for g in (0, 1):
        assert parts(s.handle(done(GEN, 0, g))) == []
    assert parts(s.handle(done(GEN, 0, 2))) == [(0, 0, 0), (1, 0, 0), (2, 0, 0)]
    assert s.handle(done(TRAIN, 0, 0, "t0", part=0), done(TRAIN, 0, 2, "t0", part=0)) == []
    assert s.handle(done(TRAIN, 0, 1, "t0", part=0)) == [Step(0, 0)]
    out = s.handle(StepDone(0, 1.0, 1.1, mini_batch=0))
    assert parts(out) == [(0, 1, 1), (1, 1, 1), (2, 1, 1)]  # mini-batch 1 at version 1
    s.handle(done(TRAIN, 0, 0, "t0", part=1), done(TRAIN, 0, 1, "t0", part=1))
    assert s.handle(done(TRAIN, 0, 2, "t0", part=1)) == [Step(0, 1)]
    out = s.handle(StepDone(0, 2.0, 2.1, mini_batch=1))
    assert releases(out, GEN) == [(1, g, 2) for g in range(3)]


def test_samples_split_learns_a_train_task_as_one_mth_of_a_group():
    s = make(groups=2, mini_batches=4, split_samples=True)
    s.start(0.0)
    s.handle(done(GEN, 0, 0), done(GEN, 0, 1))
    s.handle(TaskDone(TaskRef(TRAIN, 0, 0, 0), "t0", 0.0, 2.0))
    assert s.seconds[("t0", TRAIN)] == 8.0  # 2 s for a quarter of a group's samples
