"""The pure Scheduler's ``eval`` and ``reward`` tasks (no Redis, no Dask, no clock)."""

from __future__ import annotations

from digen.core.events import Finish, Role, Step, StepDone, WorkerJoined
from digen.core.policy import idle_kinds, pull_order
from digen.core.scheduler import Scheduler, SchedulerConfig
from tests.core.scheduling import EVAL, GEN, REWARD, TRAIN, done, releases


def make(*roles: tuple[str, Role], groups=2, iterations=2, **kw) -> Scheduler:
    s = Scheduler(SchedulerConfig(iterations=iterations, groups=groups, **kw))
    for name, role in roles or (("r0", Role.ROLLOUT), ("t0", Role.TRAINER)):
        s.handle(WorkerJoined(name, role, "cpu", 0.0))
    return s


def run_iteration(s: Scheduler, k: int, groups: int = 2, gens: bool = True) -> list:
    """Generate (when ``gens``) and train iteration ``k``, step it; returns what StepDone gives."""
    out = []
    for g in range(groups) if gens else ():
        out += s.handle(done(GEN, k, g))
    for g in range(groups):
        out += s.handle(done(TRAIN, k, g, "t0"))
    assert Step(k) in out
    return s.handle(StepDone(k, 0.0, 1.0))


def test_eval_tasks_wait_until_no_generation_task_is_ready():
    s = make(iterations=3, eval_every=1, eval_tasks=2)
    s.start(0.0)
    out = run_iteration(s, 0)
    # the step of iteration 0 releases iteration 1's generation: evaluating version 1 waits
    assert releases(out, GEN) == [(1, 0, 1), (1, 1, 1)]
    assert releases(out, EVAL) == []
    assert releases(s.handle(done(GEN, 1, 0)), EVAL) == []  # one generation task still ready
    out = s.handle(done(GEN, 1, 1))
    # the rollout worker is idle now: one task per evaluating worker, the next when it is done
    assert releases(out, EVAL) == [(0, 0, 1)]
    assert releases(out, TRAIN) == [(1, 0, 1), (1, 1, 1)]
    assert releases(s.handle(done(EVAL, 0, 0)), EVAL) == [(0, 1, 1)]


def test_eval_tasks_in_flight_at_most_one_per_evaluating_worker_none_left_queued():
    s = make(
        ("r0", Role.ROLLOUT),
        ("r1", Role.ROLLOUT),
        ("t0", Role.TRAINER),
        iterations=3,
        eval_every=1,
        eval_tasks=3,
    )
    s.start(0.0)
    out = run_iteration(s, 0)
    out = s.handle(done(GEN, 1, 0), done(GEN, 1, 1))
    assert releases(out, EVAL) == [(0, 0, 1), (0, 1, 1)]  # two rollout workers
    for g in range(2):
        s.handle(done(TRAIN, 1, g, "t0"))
    out = s.handle(StepDone(1, 0.0, 1.0))  # generation of iteration 2 is out: no more eval
    assert releases(out, GEN) and releases(out, EVAL) == []
    assert releases(s.handle(done(EVAL, 0, 0)), EVAL) == []
    out = s.handle(done(GEN, 2, 0), done(GEN, 2, 1))
    # idle again: chunk 2 of the first evaluation, then the next evaluation's first chunk
    assert releases(out, EVAL) == [(0, 2, 1)]
    assert releases(s.handle(done(EVAL, 0, 1)), EVAL) == [(1, 0, 2)]


def test_eval_every_n_iterations_and_at_the_end_and_finish_waits_for_it():
    s = make(iterations=5, eval_every=2, eval_tasks=1)
    s.start(0.0)
    evaluated, out = [], []
    for k in range(5):
        out = run_iteration(s, k, gens=k == 0)
        if k < 4:  # the next iteration's generation done: the rollout worker is idle
            for g in range(2):
                out += s.handle(done(GEN, k + 1, g))
        evaluated += [(it, v) for it, _, v in releases(out, EVAL)]
        if k < 4:
            for it, c, _ in releases(out, EVAL):
                s.handle(done(EVAL, it, c))
    assert evaluated == [(1, 2), (3, 4), (4, 5)]  # (iteration, version evaluated)
    assert Finish() not in out  # the last evaluation is still running
    assert s.handle(done(EVAL, 4, 0)) == [Finish()]


def test_colocated_eval_also_waits_for_train_tasks():
    s = make(("c0", Role.COLOCATED), iterations=1, eval_every=1, eval_tasks=1)
    s.start(0.0)
    s.handle(done(GEN, 0, 0, "c0"), done(GEN, 0, 1, "c0"))
    s.handle(done(TRAIN, 0, 0, "c0"))
    out = s.handle(done(TRAIN, 0, 1, "c0"))
    assert out == [Step(0)]
    out = s.handle(StepDone(0, 0.0, 1.0))
    assert releases(out, EVAL) == [(0, 0, 1)] and Finish() not in out
    assert s.handle(done(EVAL, 0, 0, "c0")) == [Finish()]


def test_reward_workers_turn_scoring_into_tasks():
    s = make(("r0", Role.ROLLOUT), ("t0", Role.TRAINER), ("s0", Role.REWARD), gap=True)
    s.start(0.0)
    assert s.reward_tasks
    out = s.handle(done(GEN, 0, 1))
    assert releases(out, REWARD) == [(0, 1, 0)] and releases(out, TRAIN) == []
    out = s.handle(done(REWARD, 0, 1, "s0"))
    assert releases(out, TRAIN) == [(0, 1, 0)]  # scored: its training goes (GAP)


def test_without_reward_workers_generation_scores_inline():
    s = make(gap=True)
    s.start(0.0)
    assert not s.reward_tasks
    out = s.handle(done(GEN, 0, 0))
    assert releases(out, REWARD) == [] and releases(out, TRAIN) == [(0, 0, 0)]


def test_pull_orders_of_the_new_kinds():
    assert pull_order(Role.REWARD, 0) == [REWARD]
    assert idle_kinds(Role.ROLLOUT) == [EVAL] and idle_kinds(Role.COLOCATED) == [EVAL]
    assert idle_kinds(Role.TRAINER) == [] and idle_kinds(Role.REWARD) == []
