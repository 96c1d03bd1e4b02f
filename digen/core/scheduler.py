"""The pure Scheduler: events in, instructions out. The only home of scheduling policy.

It decides *when* work is released (generation of an iteration once its weights exist and the
staleness bound allows it; training of a group once it is scored, GAP; or once the whole
iteration is scored), *who* may pull what (role tags and TAG/RAT budgets, set at iteration
boundaries, which is also when joining workers start), and *when* the optimizer steps. It
learns each worker's seconds per task kind from the durations on ``TaskDone`` events.

Versions: version v is the weights after v optimizer steps. An iteration takes ``M =
mini_batches`` steps (one per mini-batch, below); iteration i generates with version
``M * max(0, i - max_staleness)`` and its mini-batch m trains version ``M * i + m``
(:mod:`digen.core.versions`, the one home of that arithmetic). With
staleness 1 the generation of iteration i+1 overlaps the training of iteration i. A generation
task carries one version: a trajectory never mixes weights.

Mini-batches (``train.mini_batches``, the peers' several optimizer steps per rollout batch):
mini-batch m of an iteration is its groups ``[m P / M, (m + 1) P / M)`` (:func:`mini_batch_of`,
P groups). Its train tasks are released once their groups are scored (GAP; else once the
iteration is) *and* version ``M i + m`` is published; :class:`Step` ``(i, m)`` follows when
they are all done, so mini-batch 0 steps while later groups may still be generating, and the
next mini-batch's tasks wait for that step. Staleness is counted in iterations (rollout
batches): ``max_staleness`` s bounds how many iterations a generation runs ahead; in versions
a trajectory trained in mini-batch m lags ``M s + m`` (at most ``M s + M - 1``): with ``M >
1`` every mini-batch after the first trains off-policy even at s = 0, as in the peers (the
PPO clip acts there). s = 0 is the reference loop's order exactly (digen/reference.py).

With ``split_samples`` (``train.mini_batch_split: samples``, Flow-GRPO's split) a mini-batch
is a seeded shuffle's share of the iteration's samples (:meth:`digen.iteration.IterationBook.sample_split`),
so a group's samples train in several mini-batches: mini-batch m is one train task per group,
``TaskRef(TRAIN, i, g, part=m)`` (a task with no sample of m is settled at once by the
controller), released only once *every* group of the iteration is scored (the shuffle needs
them all; GAP starts nothing early) and version ``M i + m`` is published. RAT splits no task
further (the parts are already fractions of a group).

Batched train tasks (``groups_per_task`` n > 1, ``train.groups_per_task``): a train task
carries n consecutive whole groups (:func:`task_groups`: each mini-batch's groups, with
``split_samples`` the iteration's, cut from its first in runs of n, the last run taking what
is left) and is named by its first group, ``TaskRef(TRAIN, i, first[, part])``; the other
groups of the run have no task of their own. GAP releases a task once all of its groups are
scored. The composition is the config's alone (never the order groups happened to be scored
in), so the float result does not depend on timing. RAT splits no batched task in halves;
a rollout worker's budget counts whole tasks then.

In the runtime (:mod:`digen.runtime.steps`, :mod:`digen.workers.trainer`): a :class:`Step` ``(i, m)``
sums only mini-batch m's task gradients and steps with ``last_of_iteration = (m == M - 1)``
(an algorithm's state moves once per iteration); an iteration's metrics row, checkpoint and
sample grid are written after its last mini-batch; trainers keep serving version ``M i`` (what
a staleness-1 rollout of iteration i+1 uses) through the iteration's steps; a train task and
an ``eval`` task carry the Release's version, which the worker loads.

Scoring: with reward workers (a worker of role ``reward`` known at :meth:`Scheduler.start`) a
finished generation task releases a ``reward`` task for its group, and the group counts as
scored when that one is done; without, generation tasks score inline.

Evaluation (``eval_every``): after the step of every ``eval_every``-th iteration and of the
last one, ``eval_tasks`` ``eval`` tasks of the new version wait. They are released while the
workers that evaluate (rollout and colocated ones) have no generation task released and not
done (colocated ones: no train task either), and at most one per such worker in flight, so
that none is left queued when work comes back: workers pull ``eval`` last
(:func:`~digen.core.policy.idle_kinds`), so a task released while an ``eval`` task runs
waits for its remainder only, never for another one. :class:`Finish` waits for every
evaluation.

    sched = Scheduler(SchedulerConfig(iterations=3, groups=4, gap=True, tag=True, max_staleness=1))
    sched.handle(WorkerJoined("w0", Role.ROLLOUT, "cpu", t=0.0))
    sched.start(t=0.0)  # -> [SetRole(...), Release(TaskRef(GEN, 0, 0), version=0), ...]
"""

from __future__ import annotations

from dataclasses import dataclass, field

from digen.core import versions
from digen.core.events import (
    Event,
    Finish,
    GroupLost,
    Instruction,
    Release,
    RequeueWorker,
    Role,
    SetRole,
    Step,
    StepDone,
    TaskDone,
    TaskKind,
    TaskLost,
    TaskRef,
    TrainLost,
    WorkerJoined,
    WorkerLeft,
    work_share,
)
from digen.core.policy import assist_budgets


@dataclass(frozen=True)
class SchedulerConfig:
    iterations: int
    groups: int
    """Prompt groups per iteration (= generation tasks = train tasks)."""
    gap: bool = False
    """Release a group's training as soon as it is scored (else when the iteration is)."""
    tag: bool = False
    """Let idle trainers generate when the measured speeds say it shortens the iteration."""
    rat: bool = False
    """Let idle rollout workers train when the measured speeds say it shortens the iteration
    (rollout-assisted training: the mirror of TAG for training-bound iterations)."""
    max_staleness: int = 0
    """Iterations a generation may run ahead of training (0 or 1)."""
    mini_batches: int = 1
    """Optimizer steps per iteration (``train.mini_batches``); must divide ``groups`` unless
    ``split_samples``."""
    split_samples: bool = False
    """``train.mini_batch_split: samples``: a mini-batch is one task per group (``part`` = m),
    released once the whole iteration is scored."""
    group_local_advantages: bool = True
    """False (``train.global_std``): advantages need the whole batch, so GAP cannot start a
    group early."""
    start_iteration: int = 0
    """First iteration to run (resume): versions before it are published."""
    tag_margin: float = 0.02
    eval_every: int = 0
    """Evaluate the version after every ``eval_every``-th iteration and the last (0: never)."""
    eval_tasks: int = 0
    """``eval`` tasks per evaluation (chunks of the test prompts)."""
    groups_per_task: int = 1
    """Whole groups per train task (``train.groups_per_task``; :func:`task_groups`)."""
    task_seconds: dict[TaskKind, float] = field(default_factory=dict)
    """Seconds per group of a kind on every worker, pinned (``schedule.task_seconds``): TAG and
    RAT decide from these instead of the measured durations, so every iteration's roles and
    half-group splits follow from the config alone. Kinds left out are measured."""


@dataclass
class WorkerState:
    role: Role
    gpu_type: str
    active: bool = False
    """Has a role tag (joined before start or at an iteration boundary)."""
    budget: int = 0


@dataclass
class Scheduler:
    cfg: SchedulerConfig
    workers: dict[str, WorkerState] = field(default_factory=dict)
    stepped: int = -1
    """Last iteration whose (last mini-batch's) optimizer step is done."""
    mini_stepped: int = 0
    """Mini-batches of iteration ``stepped + 1`` whose step is done."""
    stepping: bool = False
    started: bool = False
    finished: bool = False
    gen_released: set[int] = field(default_factory=set)
    gen_done: dict[int, set[int]] = field(default_factory=dict)
    train_released: dict[int, set[int]] = field(default_factory=dict)
    """Per iteration: groups whose train tasks are released (``split_samples``: mini-batches)."""
    train_done: dict[int, set[tuple[int, int | None]]] = field(default_factory=dict)
    """Per iteration: (group, part) of every trained task."""
    splits: dict[int, int] = field(default_factory=dict)
    """Per iteration: how many of its last groups train as two halves (RAT)."""
    seconds: dict[tuple[str, TaskKind], float] = field(default_factory=dict)
    """Learned seconds per group, per (worker, kind) (exponential average, :meth:`_learn`)."""
    reward_tasks: bool = False
    """Scoring runs as ``reward`` tasks (reward workers were there at :meth:`start`)."""
    scored: dict[int, set[int]] = field(default_factory=dict)
    """Per iteration: the groups whose rewards are known."""
    in_flight: dict[TaskKind, int] = field(default_factory=dict)
    """Released and not yet done tasks, per kind."""
    evals_waiting: list[int] = field(default_factory=list)
    """Iterations whose evaluation (of version iteration + 1) is not all released yet."""
    evals_released: dict[int, int] = field(default_factory=dict)
    """Per waiting evaluation: how many of its tasks are released (in chunk order)."""
    evals_open: dict[int, set[int]] = field(default_factory=dict)
    """Per evaluated iteration: its released ``eval`` tasks not done yet."""
    regenerating: set[tuple[int, int]] = field(default_factory=set)
    """(iteration, group) generated again after :class:`GroupLost`, until done."""

    def __post_init__(self) -> None:
        c = self.cfg
        if c.mini_batches < 1 or (c.groups % c.mini_batches and not c.split_samples):
            raise ValueError(f"mini_batches ({c.mini_batches}) must be >= 1 and divide groups ({c.groups})")
        if c.groups_per_task < 1:
            raise ValueError(f"groups_per_task ({c.groups_per_task}) must be >= 1")
        self.stepped = c.start_iteration - 1

    # --- public -----------------------------------------------------------------------
    @property
    def published(self) -> int:
        """Newest published version."""
        return versions.version(self.stepped + 1, self.mini_stepped, self.cfg.mini_batches)

    def gen_version(self, iteration: int) -> int:
        """The version iteration ``iteration`` generates with."""
        return versions.generation_version(iteration, self.cfg.mini_batches, self.cfg.max_staleness)

    def train_version(self, iteration: int, group: int, part: int | None = None) -> int:
        """The version a train task of ``group`` (``part``) trains (its mini-batch's)."""
        return versions.version(iteration, self.task_mini_batch(group, part), self.cfg.mini_batches)

    def mini_batch(self, group: int) -> int:
        return mini_batch_of(group, self.cfg.groups, self.cfg.mini_batches)

    def task_mini_batch(self, group: int, part: int | None) -> int:
        """The mini-batch of a train task: its group's, or with ``split_samples`` its part."""
        return (part or 0) if self.cfg.split_samples else self.mini_batch(group)

    def task_groups(self, group: int) -> range:
        """The groups of the train task ``group`` is in (:func:`task_groups`)."""
        c = self.cfg
        return task_groups(group, c.groups, c.mini_batches, c.groups_per_task, c.split_samples)

    def _share(self, t: TaskRef) -> float:
        """The groups' work ``t`` is (``split_samples``: 1/M of its groups on average)."""
        n = len(self.task_groups(t.group)) if t.kind is TaskKind.TRAIN else 1
        return work_share(t, n, self.cfg.mini_batches, self.cfg.split_samples)

    def start(self, t: float) -> list[Instruction]:
        """Tag the workers known so far and release the first work."""
        self.started = True
        self.reward_tasks = any(w.role is Role.REWARD for w in self.workers.values())
        out: list[Instruction] = []
        for name, w in sorted(self.workers.items()):
            w.active = True
            out.append(SetRole(name, w.role, 0))
        if self.stepped + 1 >= self.cfg.iterations:
            self.finished = True
            return out + [Finish()]
        return out + self._advance()

    def handle(self, *events: Event) -> list[Instruction]:
        out: list[Instruction] = []
        for ev in events:
            out += self._handle(ev)
        return out

    # --- events -----------------------------------------------------------------------
    def _handle(self, ev: Event) -> list[Instruction]:
        if isinstance(ev, WorkerJoined):
            joined = self.workers[ev.worker] = WorkerState(ev.role, ev.gpu_type)
            if (
                self.started
                and not self.finished
                and not any(x.active and x.role is ev.role for x in self.workers.values())
            ):
                # no active worker pulls this role's work: waiting for the next iteration
                # boundary would wait forever (that boundary needs this very work)
                joined.active = True
                return [SetRole(ev.worker, ev.role, 0)]
            return []
        if isinstance(ev, WorkerLeft):
            w = self.workers.pop(ev.worker, None)
            return [RequeueWorker(ev.worker)] if w is not None else []
        if isinstance(ev, TaskLost):
            return []
        if isinstance(ev, TaskDone):
            return self._task_done(ev)
        if isinstance(ev, StepDone):
            return self._step_done(ev)
        if isinstance(ev, GroupLost):
            return self._group_lost(ev)
        if isinstance(ev, TrainLost):
            return self._train_lost(ev)
        raise TypeError(f"unknown event {ev!r}")

    def _task_done(self, ev: TaskDone) -> list[Instruction]:
        t = ev.task
        if t.kind not in self.cfg.task_seconds:
            self._learn(ev.worker, t.kind, (ev.end - ev.start) / self._share(t))  # seconds per whole group
        self.in_flight[t.kind] = max(0, self.in_flight.get(t.kind, 0) - 1)
        out: list[Instruction] = []
        if t.kind is TaskKind.GEN:
            self.gen_done.setdefault(t.iteration, set()).add(t.group)
            regenerated = (t.iteration, t.group) in self.regenerating
            self.regenerating.discard((t.iteration, t.group))
            if regenerated and t.group in self.scored.get(t.iteration, set()):
                return out  # its rewards stand; its training waits for the controller's repost
            if self.reward_tasks:
                out += self._count(
                    [Release(TaskRef(TaskKind.REWARD, t.iteration, t.group), self.gen_version(t.iteration))]
                )
            else:
                self.scored.setdefault(t.iteration, set()).add(t.group)
        elif t.kind is TaskKind.REWARD:
            self.scored.setdefault(t.iteration, set()).add(t.group)
        elif t.kind is TaskKind.EVAL:
            left = self.evals_open.get(t.iteration, set())
            left.discard(t.group)
            if not left:
                self.evals_open.pop(t.iteration, None)
        else:
            self.train_done.setdefault(t.iteration, set()).add((t.group, t.part))
        if not self.started:
            return out
        if self.stepped + 1 >= self.cfg.iterations:  # trained: only evaluations are left
            return out + self._release_evals() + self._finish()
        return out + self._advance()

    def _step_done(self, ev: StepDone) -> list[Instruction]:
        if (ev.iteration, ev.mini_batch) != (self.stepped + 1, self.mini_stepped):
            raise ValueError(
                f"step of iteration {ev.iteration} mini-batch {ev.mini_batch} reported, expected "
                f"iteration {self.stepped + 1} mini-batch {self.mini_stepped}"
            )
        self.stepping = False
        if ev.mini_batch < self.cfg.mini_batches - 1:  # the iteration's next mini-batch trains
            self.mini_stepped += 1
            return self._advance()
        self.stepped, self.mini_stepped = ev.iteration, 0
        for d in (self.gen_done, self.scored, self.train_done, self.train_released, self.splits):
            d.pop(ev.iteration, None)
        self.gen_released.discard(ev.iteration)
        if self.evaluates(ev.iteration):
            self.evals_waiting.append(ev.iteration)
        if self.stepped + 1 >= self.cfg.iterations:
            return self._release_evals() + self._finish()
        return self._retag() + self._advance()

    def _group_lost(self, ev: GroupLost) -> list[Instruction]:
        """Generate a group again (its trajectories are gone); its rewards, if known, stand
        (the new run reproduces them), so it is not scored twice."""
        i = ev.iteration
        if i <= self.stepped or i not in self.gen_released or (i, ev.group) in self.regenerating:
            return []
        self.regenerating.add((i, ev.group))
        return self._count([Release(TaskRef(TaskKind.GEN, i, ev.group), self.gen_version(i))])

    def _train_lost(self, ev: TrainLost) -> list[Instruction]:
        """Train tasks to run again; the iteration's step, if asked for, waits for them."""
        i = ev.iteration
        if i != self.stepped + 1:
            return []
        done = self.train_done.get(i, set())
        out: list[Instruction] = []
        for group, part in ev.tasks:
            if (group, part) in done:
                done.discard((group, part))
                out.append(
                    Release(TaskRef(TaskKind.TRAIN, i, group, part), self.train_version(i, group, part))
                )
        if out:
            self.stepping = False
        return self._count(out)

    def evaluates(self, iteration: int) -> bool:
        """Whether the version after ``iteration`` is evaluated."""
        c = self.cfg
        every = c.eval_every
        return (
            every > 0 and c.eval_tasks > 0 and ((iteration + 1) % every == 0 or iteration == c.iterations - 1)
        )

    # --- policy -----------------------------------------------------------------------
    def _advance(self) -> list[Instruction]:
        """Release everything the rules allow now; step when an iteration is trained."""
        out: list[Instruction] = []
        c = self.cfg
        # generation: weights exist and at most max_staleness iterations ahead of training
        for i in range(self.stepped + 1, min(c.iterations, self.stepped + 2 + c.max_staleness)):
            if i in self.gen_released or self.gen_version(i) > self.published:
                continue
            self.gen_released.add(i)
            out += [Release(TaskRef(TaskKind.GEN, i, g), self.gen_version(i)) for g in range(c.groups)]
        # training of the current iteration's current mini-batch (its version is published)
        i, m = self.stepped + 1, self.mini_stepped
        if i < c.iterations:
            scored = self.scored.get(i, set())
            released = self.train_released.setdefault(i, set())
            whole = len(scored) == c.groups
            if c.split_samples:  # one task per group (run), once the whole iteration is scored
                if whole and m not in released:
                    released.add(m)
                    v = self.train_version(i, 0, m)
                    out += [
                        Release(TaskRef(TaskKind.TRAIN, i, g, m), v) for g in self._leads(range(c.groups))
                    ]
            elif len(released) < len(scored) and ((c.gap and c.group_local_advantages) or whole):
                halves = c.groups - self.splits.get(i, 0)  # groups from here on train as halves
                for g in sorted(scored - released):
                    if self.mini_batch(g) != m:  # a later mini-batch: its version is not out yet
                        continue
                    run = self.task_groups(g)
                    if g != run.start or not set(run) <= scored:  # a batched task: all its groups
                        continue
                    released.update(run)
                    parts: list[int | None] = [0, 1] if g >= halves else [None]
                    out += [
                        Release(TaskRef(TaskKind.TRAIN, i, g, p), self.train_version(i, g)) for p in parts
                    ]
            done = [g for g, p in self.train_done.get(i, ()) if self.task_mini_batch(g, p) == m]
            if not self.stepping and len(done) == self._tasks_of(i, m):
                self.stepping = True
                out.append(Step(i, m))
        return self._count(out) + self._release_evals()

    def _tasks_of(self, iteration: int, mini_batch: int) -> int:
        """Train tasks of a mini-batch: one per group, two for a group split in halves (RAT);
        ``split_samples``: one per group of the iteration."""
        c = self.cfg
        if c.split_samples:
            return len(self._leads(range(c.groups)))
        halves = c.groups - self.splits.get(iteration, 0)
        groups = self._leads(g for g in range(c.groups) if self.mini_batch(g) == mini_batch)
        return len(groups) + sum(1 for g in groups if g >= halves)

    def _leads(self, groups) -> list[int]:
        """The first group of each train task among ``groups``."""
        return [g for g in groups if self.task_groups(g).start == g]

    def _count(self, out: list[Instruction]) -> list[Instruction]:
        for ins in out:
            if isinstance(ins, Release):
                self.in_flight[ins.task.kind] = self.in_flight.get(ins.task.kind, 0) + 1
        return out

    def _evaluators_busy(self) -> bool:
        """A generation task (for colocated workers: or a train task) is released and not done:
        the workers that evaluate have work an iteration needs."""
        if self.in_flight.get(TaskKind.GEN, 0) > 0:
            return True
        colocated = any(w.role is Role.COLOCATED for w in self.workers.values())
        return colocated and self.in_flight.get(TaskKind.TRAIN, 0) > 0

    def _evaluators(self) -> int:
        """Workers that pull ``eval`` tasks (at least 1: a later one will)."""
        kinds = (Role.ROLLOUT, Role.COLOCATED)
        return max(1, sum(w.active and w.role in kinds for w in self.workers.values()))

    def _release_evals(self) -> list[Instruction]:
        """Waiting evaluations' next tasks, oldest first, while the evaluating workers are
        idle: one per evaluating worker in flight at most, so none waits in the queue for
        the moment work comes back (it would take an idle worker between two tasks)."""
        out: list[Instruction] = []
        slots = self._evaluators() - self.in_flight.get(TaskKind.EVAL, 0)
        while self.evals_waiting and slots > 0 and not self._evaluators_busy():
            k = self.evals_waiting[0]
            c = self.evals_released.get(k, 0)
            self.evals_open.setdefault(k, set()).add(c)
            out.append(
                Release(TaskRef(TaskKind.EVAL, k, c), versions.published_after(k, self.cfg.mini_batches))
            )
            slots -= 1
            self.evals_released[k] = c + 1
            if c + 1 == self.cfg.eval_tasks:
                self.evals_waiting.pop(0)
                del self.evals_released[k]
        return self._count(out)

    def _finish(self) -> list[Instruction]:
        """Finish once the last step and every evaluation are done."""
        if self.finished or self.evals_waiting or self.evals_open:
            return []
        self.finished = True
        return [Finish()]

    def _retag(self) -> list[Instruction]:
        """Iteration boundary: start joined workers, and (TAG, RAT) re-balance the roles."""
        out: list[Instruction] = []
        budgets = self._budgets() if self.cfg.tag or self.cfg.rat else {}
        rat = sum(b for n, b in budgets.items() if self.workers[n].role is Role.ROLLOUT)
        if rat > 0 and not self.cfg.split_samples and self.cfg.groups_per_task == 1:
            # rollout workers may take `rat` halves: split that many (never a batched task)
            self.splits[self.stepped + 1] = min(rat, self.cfg.groups)
        for name, w in sorted(self.workers.items()):
            budget = budgets.get(name, 0)
            # a budget is spent in the queue as trainers steal, so a positive one is re-issued
            # every iteration, even when its value did not change
            if not w.active or budget != w.budget or budget > 0:
                w.active, w.budget = True, budget
                out.append(SetRole(name, w.role, budget))
        return out

    def _budgets(self) -> dict[str, int]:
        """Off-role budgets from the learned (or pinned: ``task_seconds``) seconds per group: TAG for trainers when
        generation is the bottleneck (in groups), RAT for rollout workers when training is
        (in half groups). A worker without a measured duration of a kind counts as the mean
        worker that has one; nothing is decided before each side has measured its own kind
        at least once."""
        active = {n: w for n, w in self.workers.items() if w.active}
        rollouts = sorted(n for n, w in active.items() if w.role is Role.ROLLOUT)
        trainers = sorted(n for n, w in active.items() if w.role is Role.TRAINER)
        pinned = self.cfg.task_seconds

        def known(n: str, kind: TaskKind) -> float | None:
            return pinned.get(kind, self.seconds.get((n, kind)))

        gen_m = [s for n in rollouts if (s := known(n, TaskKind.GEN)) is not None]
        train_m = [s for n in trainers if (s := known(n, TaskKind.TRAIN)) is not None]
        if not gen_m or not train_m:
            return {}
        mean_gen, mean_train = sum(gen_m) / len(gen_m), sum(train_m) / len(train_m)

        def secs(names: list[str], kind: TaskKind, default: float) -> dict[str, float]:
            out = {n: known(n, kind) for n in names}
            return {n: default if s is None else s for n, s in out.items()}

        gen, train = secs(rollouts, TaskKind.GEN, mean_gen), secs(trainers, TaskKind.TRAIN, mean_train)
        g, margin = self.cfg.groups, self.cfg.tag_margin
        out: dict[str, int] = {}
        if self.cfg.tag:
            gen_t = secs(trainers, TaskKind.GEN, mean_gen)
            out.update(assist_budgets(g, list(gen.values()), train, gen_t, margin=margin))
        if self.cfg.rat and not any(out.values()):
            train_r = secs(rollouts, TaskKind.TRAIN, mean_train)
            if self.cfg.groups_per_task == 1:
                out.update(assist_budgets(g, list(train.values()), gen, train_r, margin=margin, parts=2))
            else:  # batched tasks are not split: a budget of whole tasks (groups // groups_per_task)
                got = assist_budgets(g, list(train.values()), gen, train_r, margin=margin)
                out.update({w: b // self.cfg.groups_per_task for w, b in got.items()})
        return out

    def _learn(self, worker: str, kind: TaskKind, seconds: float, alpha: float = 0.2) -> None:
        """Exponential average of a worker's seconds per group of a kind: alpha 0.2 weighs
        about the last iteration's tasks (one task's noise alone would flip TAG/RAT
        decisions), while a worker's first measurement is taken as it is."""
        key = (worker, kind)
        old = self.seconds.get(key)
        self.seconds[key] = seconds if old is None else (1 - alpha) * old + alpha * seconds


def task_groups(
    group: int, groups: int, mini_batches: int, per_task: int, split_samples: bool = False
) -> range:
    """The groups of the train task that trains ``group`` (``per_task``: ``train.groups_per_task``):
    its mini-batch's groups (with ``split_samples`` every group of the iteration) cut from the
    first in consecutive runs of ``per_task``, the last run taking what is left. The task is
    named by the run's first group."""
    if per_task <= 1:
        return range(group, group + 1)
    if split_samples:
        lo, hi = 0, groups
    else:
        m = mini_batch_of(group, groups, mini_batches)
        lo, hi = -(-m * groups // mini_batches), -(-(m + 1) * groups // mini_batches)
    start = lo + (group - lo) // per_task * per_task
    return range(start, min(start + per_task, hi))


def mini_batch_of(group: int, groups: int, mini_batches: int) -> int:
    """The mini-batch of ``group`` among ``groups`` groups split into ``mini_batches``
    consecutive equal runs (group order is the iteration's seeded prompt order)."""
    return group * mini_batches // groups
