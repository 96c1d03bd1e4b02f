"""The pure Scheduler: events in, instructions out (no Redis, no Dask, no clock)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from digen.core.events import (
    Finish,
    Release,
    RequeueWorker,
    Role,
    SetRole,
    Step,
    StepDone,
    TaskDone,
    TaskKind,
    TaskRef,
    WorkerJoined,
    WorkerLeft,
)
from digen.core.policy import assist_budgets, pull_order, split_by_speed
from digen.core.scheduler import Scheduler, SchedulerConfig
from tests.core.scheduling import GEN, TRAIN, done, make, releases


def test_start_tags_workers_and_releases_first_iteration():
    s = make()
    out = s.start(0.0)
    assert SetRole("r0", Role.ROLLOUT, 0) in out and SetRole("t0", Role.TRAINER, 0) in out
    assert releases(out, GEN) == [(0, 0, 0), (0, 1, 0)]
    assert releases(out, TRAIN) == []


def test_without_gap_training_waits_for_the_whole_iteration():
    s = make(gap=False)
    s.start(0.0)
    assert releases(s.handle(done(GEN, 0, 1)), TRAIN) == []
    assert releases(s.handle(done(GEN, 0, 0)), TRAIN) == [(0, 0, 0), (0, 1, 0)]


def test_gap_releases_a_group_as_soon_as_it_is_scored():
    s = make(gap=True)
    s.start(0.0)
    assert releases(s.handle(done(GEN, 0, 1)), TRAIN) == [(0, 1, 0)]
    assert releases(s.handle(done(GEN, 0, 0)), TRAIN) == [(0, 0, 0)]


def test_gap_with_global_std_waits_for_the_batch():
    s = make(gap=True, group_local_advantages=False)
    s.start(0.0)
    assert releases(s.handle(done(GEN, 0, 1)), TRAIN) == []
    assert len(releases(s.handle(done(GEN, 0, 0)), TRAIN)) == 2


def test_step_after_all_train_tasks_then_next_iteration_and_finish():
    s = make(gap=True)
    s.start(0.0)
    s.handle(done(GEN, 0, 0), done(GEN, 0, 1))
    assert s.handle(done(TRAIN, 0, 0, "t0")) == []
    assert s.handle(done(TRAIN, 0, 1, "t0")) == [Step(0)]
    out = s.handle(StepDone(0, 2.0, 2.1))
    assert releases(out, GEN) == [(1, 0, 1), (1, 1, 1)]  # synchronous: version 1
    s.handle(done(GEN, 1, 0), done(GEN, 1, 1), done(TRAIN, 1, 0, "t0"))
    assert s.handle(done(TRAIN, 1, 1, "t0")) == [Step(1)]
    assert s.handle(StepDone(1, 3.0, 3.1)) == [Finish()]


def test_staleness_one_overlaps_next_generation_with_training():
    s = make(gap=True, max_staleness=1, iterations=3)
    out = s.start(0.0)
    # iterations 0 and 1 both generate with version 0 at once
    assert releases(out, GEN) == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]
    s.handle(done(GEN, 0, 0), done(GEN, 0, 1), done(GEN, 1, 0), done(GEN, 1, 1))
    # iteration 1's training is not released before version 1 exists
    out = s.handle(done(TRAIN, 0, 0, "t0"), done(TRAIN, 0, 1, "t0"))
    assert releases(out, TRAIN) == [] and Step(0) in out
    out = s.handle(StepDone(0, 1.0, 1.1))
    assert releases(out, TRAIN) == [(1, 0, 1), (1, 1, 1)]
    assert releases(out, GEN) == [(2, 0, 1), (2, 1, 1)]  # two versions ahead is never allowed


def test_staleness_bound_holds_for_every_release():
    s = make(gap=True, max_staleness=1, iterations=6, groups=3)
    pending = s.start(0.0)
    trained_at = {}
    t = 0.0
    while True:
        gens = [i for i in pending if isinstance(i, Release) and i.task.kind is GEN]
        trains = [i for i in pending if isinstance(i, Release) and i.task.kind is TRAIN]
        steps = [i for i in pending if isinstance(i, Step)]
        if any(isinstance(i, Finish) for i in pending):
            break
        pending = []
        for g in gens:
            assert g.task.iteration - g.version <= 1
            trained_at[(g.task.iteration, g.task.group)] = g.version
            pending += s.handle(done(GEN, g.task.iteration, g.task.group, s=t, e=t + 1))
        for tr in trains:
            assert tr.version == tr.task.iteration
            pending += s.handle(done(TRAIN, tr.task.iteration, tr.task.group, "t0", t, t + 1))
        for st in steps:
            pending += s.handle(StepDone(st.iteration, t, t + 0.1))
        t += 1
    assert len(trained_at) == 18


def test_worker_joining_mid_job_is_tagged_at_the_next_boundary():
    s = make(gap=True)
    s.start(0.0)
    assert s.handle(WorkerJoined("r1", Role.ROLLOUT, "l40", 0.5)) == []
    s.handle(done(GEN, 0, 0), done(GEN, 0, 1), done(TRAIN, 0, 0, "t0"), done(TRAIN, 0, 1, "t0"))
    out = s.handle(StepDone(0, 1.0, 1.1))
    assert SetRole("r1", Role.ROLLOUT, 0) in out


def test_worker_leaving_requeues_its_tasks():
    s = make()
    s.start(0.0)
    assert s.handle(WorkerLeft("r0", 1.0)) == [RequeueWorker("r0")]
    assert s.handle(WorkerLeft("r0", 1.0)) == []


def test_tag_gives_idle_trainer_a_budget_when_generation_is_the_bottleneck():
    s = make(gap=True, tag=True, groups=8, iterations=3)
    s.start(0.0)
    for g in range(8):
        s.handle(done(GEN, 0, g, "r0", 0, 3.0))  # generation: 3 s per group
    for g in range(8):
        s.handle(done(TRAIN, 0, g, "t0", 0, 1.0))  # training: 1 s per group
    out = s.handle(StepDone(0, 10, 10.1))
    tags = [i for i in out if isinstance(i, SetRole) and i.worker == "t0"]
    assert tags and tags[0].budget > 0


def test_tag_stays_off_when_training_is_the_bottleneck():
    s = make(gap=True, tag=True, groups=8, iterations=3)
    s.start(0.0)
    for g in range(8):
        s.handle(done(GEN, 0, g, "r0", 0, 1.0))
    for g in range(8):
        s.handle(done(TRAIN, 0, g, "t0", 0, 3.0))
    out = s.handle(StepDone(0, 10, 10.1))
    assert not [i for i in out if isinstance(i, SetRole) and i.budget > 0]


def test_assist_budgets_balance_and_never_lengthen():
    # TAG: gen 3 s/group on one rollout, train 1 s/group: best is to move ~2 of 8 groups
    b = assist_budgets(8, [3.0], {"t0": 1.0}, {"t0": 3.0})
    assert 1 <= b["t0"] <= 3
    assert assist_budgets(8, [1.0], {"t0": 3.0}, {"t0": 1.0}) == {"t0": 0}
    # RAT (owners = trainers): train 1.2 s/group, gen 1.0 s/group on the rollout, which trains
    # at 1.2 s/group too: taking 1 of 10 groups gives max(10 + 1.2, 9 * 1.2) = 11.2 < 12
    assert assist_budgets(10, [1.2], {"r0": 1.0}, {"r0": 1.2}) == {"r0": 1}
    # in half groups: 2 halves give max(10 + 1.2, 12 - 1.2) = 11.2
    assert assist_budgets(10, [1.2], {"r0": 1.0}, {"r0": 1.2}, parts=2) == {"r0": 2}
    # a near-balanced iteration gains less than the margin: nothing moves
    assert assist_budgets(10, [1.01], {"r0": 1.0}, {"r0": 1.01}) == {"r0": 0}
    assert split_by_speed(5, {"a": 1.0, "b": 4.0}, ["a", "b"]) == {"a": 1, "b": 4}


def test_pull_order():
    assert pull_order(Role.ROLLOUT, 0) == [GEN]
    assert pull_order(Role.ROLLOUT, 5) == [GEN, TRAIN]
    assert pull_order(Role.TRAINER, 0) == [TRAIN]
    assert pull_order(Role.TRAINER, 2) == [TRAIN, GEN]
    assert pull_order(Role.COLOCATED, 0) == [GEN, TRAIN]


def test_rat_gives_idle_rollout_half_groups_of_training_when_training_is_the_bottleneck():
    s = make(gap=True, tag=True, rat=True, groups=10, iterations=3)
    s.start(0.0)
    for g in range(10):
        s.handle(done(GEN, 0, g, "r0", 0, 1.0))
    for g in range(10):
        s.handle(done(TRAIN, 0, g, "t0", 0, 1.2))
    out = s.handle(StepDone(0, 12, 12.1))
    # gen 1.0 s/group, train 1.2 s/group: 2 halves to the rollout worker give
    # max(10 + 2 * 0.6, 12 - 2 * 0.6) = 11.2 s < 12 s
    budgets = {i.worker: i.budget for i in out if isinstance(i, SetRole)}
    assert budgets["r0"] == 2 and budgets.get("t0", 0) == 0
    # the last 2 groups of iteration 1 train as halves (released last: what an idle rollout
    # worker finds in the queue), the others whole
    released = []
    for g in range(10):
        released += [i.task for i in s.handle(done(GEN, 1, g, "r0", 0, 1.0)) if isinstance(i, Release)]
    train = [(t.group, t.part) for t in released if t.kind is TRAIN]
    assert train == [(g, None) for g in range(8)] + [(8, 0), (8, 1), (9, 0), (9, 1)]
    assert TaskRef.parse(TaskRef(TRAIN, 1, 9, 1).id) == TaskRef(TRAIN, 1, 9, 1)
    # the step waits for every half; a half's duration is learned per whole group
    steps = []
    for t in released:
        if t.kind is TRAIN:
            steps += [
                i
                for i in s.handle(TaskDone(t, "r0" if t.part == 1 else "t0", 0, 0.6 * t.share / 0.5))
                if isinstance(i, Step)
            ]
    assert steps == [Step(1)]
    assert s.seconds[("r0", TRAIN)] == pytest.approx(1.2)


def test_rat_stays_off_when_disabled_or_generation_is_the_bottleneck():
    for rat, gen_s, train_s in ((False, 1.0, 1.2), (True, 3.0, 1.0)):
        s = make(gap=True, rat=rat, groups=10, iterations=3)
        s.start(0.0)
        for g in range(10):
            s.handle(done(GEN, 0, g, "r0", 0, gen_s))
        for g in range(10):
            s.handle(done(TRAIN, 0, g, "t0", 0, train_s))
        out = s.handle(StepDone(0, 12, 12.1))
        assert not [i for i in out if isinstance(i, SetRole) and i.budget > 0], (rat, gen_s)


def test_pinned_task_seconds_decide_tag_and_rat_whatever_was_measured():
    # measured: generation 1 s/group, training 1 s/group (balanced: nothing would move)
    def budgets(pinned: dict[TaskKind, float]) -> dict[str, int]:
        s = make(gap=True, tag=True, rat=True, groups=4, iterations=3, task_seconds=pinned)
        s.start(0.0)
        for g in range(4):
            s.handle(done(GEN, 0, g, "r0", 0, 1.0), done(TRAIN, 0, g, "t0", 0, 1.0))
        out = s.handle(StepDone(0, 8, 8.1))
        assert s.seconds.keys().isdisjoint({(w, k) for w in ("r0", "t0") for k in pinned})
        given = {i.worker: i.budget for i in out if isinstance(i, SetRole)}
        return {w: given.get(w, 0) for w in ("r0", "t0")}

    assert budgets({}) == {"r0": 0, "t0": 0}
    # pinned training 3 s/group: 3 halves to the rollout worker, max(4 + 4.5, 12 - 4.5) = 8.5 < 12
    assert budgets({TRAIN: 3.0}) == {"r0": 3, "t0": 0}
    # pinned generation 8 s/group (the trainer generates at 8 s too): 2 groups to the trainer
    assert budgets({GEN: 8.0}) == {"r0": 0, "t0": 2}


def test_resume_starts_at_the_checkpointed_iteration():
    s = Scheduler(SchedulerConfig(iterations=4, groups=1, start_iteration=2, max_staleness=1))
    out = s.start(0.0)
    assert releases(out, GEN) == [(2, 0, 1), (3, 0, 2)]


@pytest.mark.slow
def test_core_imports_stay_light():
    code = "import sys, digen.core.scheduler; bad = [m for m in ('torch', 'dask', 'redis', 'rq', 'distributed') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_tag_budget_is_reissued_every_iteration():
    s = make(gap=True, tag=True, groups=8, iterations=4)
    s.start(0.0)
    for it in range(2):
        for g in range(8):
            s.handle(done(GEN, it, g, "r0", 0, 3.0))
        for g in range(8):
            s.handle(done(TRAIN, it, g, "t0", 0, 1.0))
        out = s.handle(StepDone(it, 10 + it, 10.1 + it))
        tags = [i for i in out if isinstance(i, SetRole) and i.worker == "t0"]
        assert tags and tags[0].budget > 0, f"no budget after iteration {it}"


def test_a_role_without_active_workers_is_tagged_when_its_first_worker_joins():
    # the job started before Dask listed any trainer: a trainer that joins later must not
    # wait for an iteration boundary that needs its own work
    s = Scheduler(SchedulerConfig(iterations=2, groups=1))
    s.handle(WorkerJoined("r0", Role.ROLLOUT, "cpu", 0.0))
    s.start(0.0)
    assert s.handle(WorkerJoined("t0", Role.TRAINER, "cpu", 1.0)) == [SetRole("t0", Role.TRAINER, 0)]
    # a second trainer joins at the next boundary, as any worker joining a running job
    assert s.handle(WorkerJoined("t1", Role.TRAINER, "cpu", 1.0)) == []
