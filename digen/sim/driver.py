"""Discrete-event driver: runs a job's iterations through the real :class:`Scheduler`.

A heap of events on a simulated clock. The driver plays both the controller and the
workers of the runtime (``digen/runtime/controller.py``, ``workers/loop.py``):

- it feeds the Scheduler the controller's events (``WorkerJoined`` before ``start``,
  ``TaskDone`` with start/end, ``StepDone`` after the optimizer step and the weight
  publication) and carries out its instructions (``Release`` into the queues, ``SetRole``
  into the role tags and TAG budgets, ``Step``, ``Finish``);
- idle simulated workers *pull* from the queues in :func:`digen.core.policy.pull_order` of
  their tag, as ``digen.workers.loop.next_task`` does: a trainer takes a generation task only when
  no train task is ready and its TAG budget (reset by each ``SetRole``) is positive, a rollout
  worker takes a train task only when no generation task is ready and its RAT budget is
  positive, and each stolen task spends 1.

An FSDP trainer group (a full fine-tune, ``train.fsdp``: :attr:`CostModel.fsdp_group`) is
one trainer, as in the runtime (:mod:`digen.workers.fsdp_loop`): its leader leases a train
task and every rank trains its share of the rows together, so a train task occupies every
rank for its duration (:meth:`_Sim.run_group`); TAG and RAT are off, as ``train.fsdp`` turns
them off (a rank holds 1/N of the weights and cannot generate alone; a rollout worker's
gradient cannot reach the sharded optimizer).

Task durations come from a :class:`~digen.sim.costmodel.CostModel`. A worker loading a new
weights version pays ``load_s``; one switching between generation and training pays
``context_switch_s`` (colocated peers: ``phase_switch_s``, offload/reload).

The data plane (:mod:`digen.sim.dataplane`) is charged where the runtime pays it: the step
(all-reduce, then AdamW) on the controller's lane between the last train task and
``StepDone``; a rollout worker's fetch of a new version on its own lane, before the load, at
its first task of that version (trainers serve the versions they make, colocated workers are
all trainers: they fetch nothing); a train task's fetch of its group's trajectories on the
training worker's lane, unless that worker generated the group itself.

Measured window: a mode's metrics are its steady state, the iterations between ``warmup``
ones (pipeline fill; TAG and RAT learn speeds in iteration 0) and ``trailing`` ones. The
job's last iteration has no next iteration whose generation it overlaps (with RAT its rollout
workers all train): a window that ends with it makes pipelined modes look faster than they
run, faster even than the bound (:mod:`digen.sim.bounds`). Every mode is measured on the
same window.

    res = simulate(cost, MODES["digen"], roles, iterations=8, warmup=3, trailing=1)
    res.samples_per_s, res.bubble_ratio, res.rows  # rows: timeline.jsonl objects
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field, replace

from digen.core.events import (
    Finish,
    Instruction,
    Release,
    Role,
    SetRole,
    Step,
    StepDone,
    TaskDone,
    TaskKind,
    TaskRef,
    WorkerJoined,
)
from digen.core.policy import pull_order
from digen.core.scheduler import Scheduler, SchedulerConfig
from digen.core.timeline import TimelineRow
from digen.errors import ConfigError, DigenError
from digen.sim.costmodel import CostModel, SimWorker
from digen.sim.dataplane import DataPlaneSeconds
from digen.sim.measure import (
    BUSY_KINDS,
    SimResult,
    measure_rows,
)

GEN, TRAIN = TaskKind.GEN, TaskKind.TRAIN


@dataclass(frozen=True)
class Mode:
    """A schedule to simulate: how it maps onto :class:`SchedulerConfig` and the driver."""

    name: str
    colocated: bool = False
    gap: bool = False
    tsp: bool = False
    tag: bool = False
    rat: bool = False
    max_staleness: int = 0
    peer_overheads: bool = False
    """digen's own per-sample tasks plus an offload/reload at each phase switch and an
    old-log-prob recompute before training: a colocated strawman, not a peer (the peers are
    the ``peer`` modes)."""
    static_shares: bool = False
    """SPMD data parallelism, as the colocated peers split a batch: task ``g`` (its
    generation and its training) belongs to worker ``g mod N``; nobody pulls another's."""
    peer: str | None = None
    """A peer's own iteration, restated from its code (:mod:`digen.sim.peers`): the key of
    its recipe in the catalog's ``peers``; phase-serial, no Scheduler."""

    @property
    def disaggregated(self) -> bool:
        return not self.colocated


def _ladder() -> dict[str, Mode]:
    d = "disaggregated"
    modes = [
        # the peers, each restated from its code (digen/sim/peers.py, catalog peers:)
        *(Mode(p, colocated=True, peer=p) for p in PEERS),
        Mode("colocated", colocated=True, peer_overheads=True, static_shares=True),
        Mode(d),
        # the ablation ladder, cumulative
        Mode("disagg+gap", gap=True),
        Mode("disagg+gap+tsp", gap=True, tsp=True),
        Mode("disagg+gap+tsp+tag", gap=True, tsp=True, tag=True),
        Mode("digen", gap=True, tsp=True, tag=True, rat=True, max_staleness=1),
        # each technique alone (disagg+gap is the first rung)
        Mode("disagg+tsp", tsp=True),
        Mode("disagg+tag", tag=True),
        Mode("disagg+async", max_staleness=1),
        # digen's own colocated mode (the runtime's: no offload, log-probs reused)
        Mode("colocated-digen", colocated=True),
    ]
    return {m.name: m for m in modes}


PEERS = ["verl-omni-unbatched", "verl-omni", "verl-omni-async", "unirl-async", "genrl", "flow-grpo"]
"""The peer modes (:mod:`digen.sim.peers`): VeRL-Omni as its published 2026-04 runs ran (one
image per generation call) and as a1139ba runs (batched generation), VeRL-Omni's
``separate_async`` and UniRL's async trainer (standalone rollout GPUs, one batch ahead),
GenRL, Flow-GRPO."""
MODES: dict[str, Mode] = _ladder()
LADDER = ["disaggregated", "disagg+gap", "disagg+gap+tsp", "disagg+gap+tsp+tag", "digen"]
ALONE = ["disagg+gap", "disagg+tsp", "disagg+tag", "disagg+async"]
DEFAULT_MODES = [*PEERS, "colocated", *LADDER]


def parse_modes(text: str | None) -> list[str]:
    """``"colocated,digen"`` -> names; ``"all"`` -> every mode; None -> the default set."""
    if not text:
        return list(DEFAULT_MODES)
    if text.strip() == "all":
        return list(MODES)
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in MODES]
    if bad:
        raise ConfigError(
            f"--modes: unknown mode(s) {', '.join(bad)}; choose from {', '.join(MODES)} or 'all'"
        )
    return names


@dataclass
class _Worker:
    spec: SimWorker
    role: Role
    index: int
    budget: int = 0
    version: int | None = None
    last_kind: TaskKind | None = None
    idle: bool = False


@dataclass
class _Sim:
    cost: CostModel
    mode: Mode
    workers: dict[str, _Worker]
    sched: Scheduler
    dp: DataPlaneSeconds
    """The data plane's seconds at this split."""
    now: float = 0.0
    seq: int = 0
    heap: list = field(default_factory=list)
    gen_q: deque = field(default_factory=deque)
    train_q: deque = field(default_factory=deque)
    waiting: list[TaskRef] = field(default_factory=list)
    """Released train tasks waiting for the other micro-batches of their prompt groups."""
    covered: dict[tuple[int, int], set[int]] = field(default_factory=dict)
    """(iteration, prompt group) -> its micro-batches some released train task carries."""
    """Prompt groups whose train tasks went to the queue."""
    idle: dict[Role, deque] = field(default_factory=dict)
    rows: list[tuple] = field(default_factory=list)
    step_ends: list[float] = field(default_factory=list)
    finished: bool = False
    stealers: int = 0
    """Idle trainers with a TAG budget left (skips the scan when none)."""
    own: dict[int, tuple[deque, deque]] = field(default_factory=dict)
    by_index: list = field(default_factory=list)
    """Static shares: each worker's own generation and train queues."""
    check: list = field(default_factory=list)
    """Static shares: workers that may have work in their own queues."""
    made_by: dict[tuple[int, int], int] = field(default_factory=dict)
    """(iteration, task) -> the index of the worker that generated it (holds its trajectories)."""
    group: list[_Worker] = field(default_factory=list)
    """The FSDP trainer group (:attr:`CostModel.fsdp_group`), leader first: it runs one train
    task at a time on every rank; empty: every trainer is a replica of its own."""
    group_s: dict[int, float] = field(default_factory=dict)
    """The group's seconds of a train task, by its micro-batches (:meth:`CostModel.group_task_s`)."""

    # --- instructions -------------------------------------------------------------------
    def apply(self, instructions: list[Instruction]) -> None:
        for ins in instructions:
            if isinstance(ins, Release):
                self.release(ins)
            elif isinstance(ins, SetRole):
                w = self.workers[ins.worker]
                if w.role is not ins.role:
                    raise DigenError(
                        f"the scheduler re-tagged {w.spec.name} from {w.role.value} to "
                        f"{ins.role.value}; the simulator keeps roles fixed"
                    )
                idle_trainer = w.role is Role.TRAINER and w.idle
                self.stealers += idle_trainer * ((ins.budget > 0) - (w.budget > 0))
                w.budget = ins.budget
            elif isinstance(ins, Step):
                self.step(ins.iteration)
            elif isinstance(ins, Finish):
                self.finished = True

    def release(self, ins: Release) -> None:
        t = ins.task
        if t.kind is GEN:
            self.enqueue(t, ins.version)
            return
        # exact GRPO: a micro-batch trains once every micro-batch of its prompt group is scored
        # (a micro-batch split in halves, RAT, counts once; its second half may come later);
        # a batched task (groups_per_task) once every prompt group it touches is
        per = self.cost.tasks_per_group
        for g in self.sched.task_groups(t.group):
            self.covered.setdefault((t.iteration, g // per), set()).add(g)
        self.waiting.append(t)
        ready = [r for r in self.waiting if self._covered(r)]
        self.waiting = [r for r in self.waiting if r not in ready]
        for ref in sorted(ready, key=lambda r: (r.group, r.part or 0)):
            self.enqueue(ref, None)

    def _covered(self, t: TaskRef) -> bool:
        per = self.cost.tasks_per_group
        keys = {(t.iteration, g // per) for g in self.sched.task_groups(t.group)}
        return all(len(self.covered.get(k, ())) == per for k in keys)

    def enqueue(self, t: TaskRef, version: int | None) -> None:
        if not self.mode.static_shares:
            (self.gen_q if t.kind is GEN else self.train_q).append((t, version))
            return
        w = self.by_index[t.group % len(self.by_index)]
        self.own[w.index][0 if t.kind is GEN else 1].append((t, version))
        if w.idle:
            self.check.append(w)

    def step(self, iteration: int) -> None:
        """The trainers all-reduce their sums, then step AdamW; then the version is served
        (rollout workers fetch it when they need it: :meth:`run`)."""
        t0 = t = self.now
        for part, dur in (("all-reduce", self.dp.reduce_s), ("AdamW step", self.dp.step_s)):
            if dur > 0:
                self.rows.append((-1, "optim", iteration, iteration, t, t + dur, part))
                t += dur
        self.push(t, ("step", iteration, t0))

    # --- workers --------------------------------------------------------------------------
    def push(self, t: float, ev: tuple) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, ev))

    def make_idle(self, w: _Worker) -> None:
        if self.group and w.role is Role.TRAINER:  # the group's task ended on every rank
            for rank in self.group:
                rank.idle = True
            return
        w.idle = True
        if self.mode.static_shares:
            self.check.append(w)
            return
        self.idle[w.role].append(w)
        self.stealers += w.role is Role.TRAINER and w.budget > 0

    def dispatch(self) -> None:
        """Hand queued tasks to idle workers, each by its tag's pull order."""
        if self.mode.static_shares:
            self.dispatch_static()
            return
        idle = self.idle
        while (self.train_q or self.gen_q) and (
            idle[Role.COLOCATED] or idle[Role.ROLLOUT] or idle[Role.TRAINER] or self.group_idle
        ):
            progressed = False
            if self.train_q and self.group_idle:  # the FSDP group: every rank at once
                self.run_group(*self.train_q.popleft())
                progressed = True
            if idle[Role.COLOCATED]:  # pull order [GEN, TRAIN]
                w = idle[Role.COLOCATED].popleft()
                if self.gen_q:
                    self.run_gen(w, self.lease_gen())
                else:
                    self.run(w, *self.train_q.popleft())
                progressed = True
            if self.train_q and idle[Role.TRAINER]:
                w = idle[Role.TRAINER].popleft()
                self.stealers -= w.budget > 0
                self.run(w, *self.train_q.popleft())
                progressed = True
            if self.gen_q and idle[Role.ROLLOUT]:
                self.run_gen(idle[Role.ROLLOUT].popleft(), self.lease_gen())
                progressed = True
            if self.gen_q and not self.train_q and self.stealers:
                w = next(
                    (x for x in idle[Role.TRAINER] if TaskKind.GEN in pull_order(x.role, x.budget)), None
                )
                if w is not None:  # TAG: steal one generation task, spend one unit of budget
                    idle[Role.TRAINER].remove(w)
                    self.stealers -= 1
                    w.budget -= 1
                    self.run(w, *self.gen_q.popleft())
                    progressed = True
            if self.mode.rat and self.train_q and not self.gen_q and idle[Role.ROLLOUT]:
                w = next(
                    (x for x in idle[Role.ROLLOUT] if TaskKind.TRAIN in pull_order(x.role, x.budget)), None
                )
                if w is not None:  # RAT: a rollout worker trains one task, one unit of budget
                    idle[Role.ROLLOUT].remove(w)
                    w.budget -= 1
                    self.run(w, *self.train_q.popleft())
                    progressed = True
            if not progressed:
                break

    @property
    def group_idle(self) -> bool:
        return bool(self.group) and self.group[0].idle

    def run_group(self, task: TaskRef, version: int | None) -> None:
        """Start train ``task`` on every rank of the FSDP group together, as the runtime's
        ranks run a leased task (:mod:`digen.workers.fsdp_loop`): each fetches the task's
        trajectories, then trains its share of the rows; the group is busy until its
        busiest rank ends (:meth:`CostModel.group_task_s`), and the leader acknowledges. A rank
        steps its own shard in place: no version to load."""
        t, leader = self.now, self.group[0]
        groups = self.sched.task_groups(task.group)
        fetched = sum(self.made_by.get((task.iteration, g), -1) not in self.group_ids for g in groups)
        parts = [("sync", fetched * self.dp.trajectory_s, "trajectory fetch")] if fetched else []
        if len(groups) not in self.group_s:
            self.group_s[len(groups)] = self.cost.group_task_s(
                [r.spec for r in self.group], len(groups), self.mode.tsp
            )
        parts.append(("train", self.group_s[len(groups)] * task.share, ""))
        for rank in self.group:
            rank.idle = False
            s = t
            for kind, dur, part in parts:
                if dur > 0:
                    self.rows.append((rank.index, kind, task.iteration, task.iteration, s, s + dur, part))
                    s += dur
        end = t + sum(dur for _, dur, _ in parts)
        self.push(end + leader.spec.cost.overhead_s, ("task", leader.spec.name, task, self.now))

    @property
    def group_ids(self) -> set[int]:
        return {r.index for r in self.group}

    def dispatch_static(self) -> None:
        """Static shares: a colocated worker runs its own generation tasks, then its own
        train tasks."""
        while self.check:
            w = self.check.pop()
            gen, train = self.own[w.index]
            if w.idle and (gen or train):
                self.run(w, *(gen or train).popleft())

    def lease_gen(self) -> list[tuple[TaskRef, int | None]]:
        """A rollout worker's lease: up to ``max_batch`` queued generation tasks of one version
        (their shapes agree: one workload), run as one forward per step (``rollout.max_batch``)."""
        first = self.gen_q.popleft()
        batch = [first]
        while self.gen_q and len(batch) < self.cost.max_batch and self.gen_q[0][1] == first[1]:
            batch.append(self.gen_q.popleft())
        return batch

    def run_gen(self, w: _Worker, batch: list[tuple[TaskRef, int | None]]) -> None:
        """Start a leased batch of generation tasks on ``w``: one denoising loop for all of them
        (:meth:`~digen.sim.costmodel.WorkerCost.gen_batch_s`), then each one's decode and
        reward; each task is acknowledged on its own when the batch ends."""
        if len(batch) == 1:
            self.run(w, *batch[0])
            return
        c, t = w.spec.cost, self.now
        w.idle = False
        first, version = batch[0]
        parts = self.prologue(w, first, version)
        n = len(batch)
        for task, _ in batch:
            self.made_by[(task.iteration, task.group)] = w.index
        gen = c.gen_batch_s(n, self.cost.samples_per_task)
        parts += [("gen", gen, ""), ("decode", n * c.decode_s, ""), ("reward", n * c.reward_s, "")]
        for kind, dur, part in parts:
            if dur > 0:
                self.rows.append((w.index, kind, first.iteration, version, t, t + dur, part))
                t += dur
        self.push(t + c.overhead_s, ("task", w.spec.name, [task for task, _ in batch], self.now))

    def prologue(self, w: _Worker, task: TaskRef, version: int | None) -> list[tuple[str, float, str]]:
        """What ``w`` does before ``task``: fetch and load a new version, switch roles."""
        c, m = w.spec.cost, self.mode
        parts: list[tuple[str, float, str]] = []
        if w.version != version:
            if w.version is not None:  # version 0 is every process's same seeded build
                if w.role is Role.ROLLOUT:  # trainers hold the versions they make
                    parts.append(("sync", self.dp.distribute_s, "weights fetch"))
                parts.append(("sync", c.load_s, "weights load"))
            w.version = version
        if w.last_kind is not None and w.last_kind is not task.kind:
            if m.peer_overheads:
                parts.append(("sync", c.phase_switch_s, "offload/reload"))
            else:
                parts.append(("sync", c.context_switch_s, "context switch"))
        w.last_kind = task.kind
        return parts

    def run(self, w: _Worker, task: TaskRef, version: int | None) -> None:
        """Start ``task`` on ``w`` now; its parts become timeline rows."""
        c, m, t = w.spec.cost, self.mode, self.now
        w.idle = False
        version = task.iteration if task.kind is TRAIN else version
        parts = self.prologue(w, task, version)
        if task.kind is GEN:
            self.made_by[(task.iteration, task.group)] = w.index
            gen = c.gen_on_trainer_s if w.role is Role.TRAINER else c.gen_s
            parts += [("gen", gen, ""), ("decode", c.decode_s, ""), ("reward", c.reward_s, "")]
        else:
            groups = self.sched.task_groups(task.group)
            fetched = sum(self.made_by.get((task.iteration, g), w.index) != w.index for g in groups)
            if fetched:  # a RAT half fetches all of its group
                parts.append(("sync", fetched * self.dp.trajectory_s, "trajectory fetch"))
            if m.peer_overheads and c.recompute_s > 0:
                parts.append(("train", len(groups) * c.recompute_s, "recompute"))  # old log-probs (peers)
            train = c.train_task_s(len(groups), m.tsp)
            parts.append(("train", train * task.share, ""))
        for kind, dur, part in parts:
            if dur > 0:
                self.rows.append((w.index, kind, task.iteration, version, t, t + dur, part))
                t += dur
        self.push(t + c.overhead_s, ("task", w.spec.name, task, self.now))

    # --- loop ----------------------------------------------------------------------------
    def loop(self) -> None:
        while self.heap and not self.finished:
            self.now, _, ev = heapq.heappop(self.heap)
            if ev[0] == "task":
                _, name, task, start = ev
                self.make_idle(self.workers[name])
                for done in task if isinstance(task, list) else [task]:  # a batch: each acknowledged
                    self.apply(self.sched.handle(TaskDone(done, name, start, self.now)))
            else:
                _, iteration, start = ev
                self.step_ends.append(self.now)
                self.apply(self.sched.handle(StepDone(iteration, start, self.now)))
            self.dispatch()
        if not self.finished:
            raise DigenError(
                f"simulation of {self.mode.name} stalled at t={self.now:.1f}s: "
                f"{len(self.gen_q)} generation and {len(self.train_q)} train tasks queued, "
                f"no worker can take them (a mode needs rollout and trainer workers)"
            )


def simulate(
    cost: CostModel,
    mode: Mode,
    roles: dict[str, Role] | None = None,
    *,
    iterations: int = 4,
    warmup: int = 1,
    trailing: int = 1,
) -> SimResult:
    """Run a job of ``iterations`` iterations of ``mode``; metrics cover those after the
    first ``warmup`` and before the last ``trailing`` (:func:`measured_window`). ``trailing
    = 0`` measures up to the job's end, as a run's own metrics do (:mod:`digen.sim.calibrate`).

    ``roles``: rollout/trainer per worker for disaggregated modes (colocated ignores it).
    """
    if min(warmup, trailing) < 0 or iterations <= warmup + trailing:
        raise ConfigError(
            f"sim.iterations ({iterations}) must exceed sim.warmup ({warmup}) + sim.trailing ({trailing}), "
            f"both at least 0: at least one iteration is measured"
        )
    if mode.peer is not None:
        return _simulate_peer(cost, mode, iterations, warmup, trailing)
    if mode.colocated:
        roles = {w.name: Role.COLOCATED for w in cost.workers}
    elif roles is None or set(roles) != {w.name for w in cost.workers}:
        raise ConfigError(f"mode {mode.name} needs a role (rollout or trainer) for every worker")
    grouped = cost.fsdp_group and not mode.colocated
    if grouped:  # train.fsdp turns TAG and RAT off (digen.config.schema.Config)
        mode = replace(mode, tag=False, rat=False)
    sched = Scheduler(
        SchedulerConfig(
            iterations=iterations,
            groups=cost.tasks,
            gap=mode.gap,
            tag=mode.tag,
            rat=mode.rat,
            max_staleness=mode.max_staleness,
            groups_per_task=cost.groups_per_task,
        )
    )
    specs = cost.split_workers({n for n, r in roles.items() if r is not Role.ROLLOUT})
    workers = {w.name: _Worker(w, roles[w.name], i) for i, w in enumerate(specs)}
    trainers = [w.gpu_type for w in cost.workers if roles[w.name] is not Role.ROLLOUT]
    rollouts = len(cost.workers) - len(trainers)
    sim = _Sim(
        cost,
        mode,
        workers,
        sched,
        cost.dataplane.for_split(trainers, rollouts),
        idle={r: deque() for r in Role},
        own={w.index: (deque(), deque()) for w in workers.values()},
        by_index=sorted(workers.values(), key=lambda w: w.index),
        group=[
            w for w in sorted(workers.values(), key=lambda w: w.index) if grouped and w.role is Role.TRAINER
        ],
    )
    for w in workers.values():
        sched.handle(WorkerJoined(w.spec.name, w.role, w.spec.gpu_type, 0.0))
        sim.make_idle(w)
    sim.apply(sched.start(0.0))
    sim.dispatch()
    sim.loop()
    res = SimResult(
        mode.name, dict(roles), _rows(sim), sim.step_ends, cost.samples, cost.gpu_count, warmup, trailing
    )
    _measure(res, sim)
    return res


def _simulate_peer(cost: CostModel, mode: Mode, iterations: int, warmup: int, trailing: int) -> SimResult:
    from digen.sim.peers import simulate_peer

    recipe = cost.paper.peers.get(mode.peer) if cost.paper is not None else None
    if cost.paper is not None and mode.peer in cost.paper.no_pipeline:
        raise ConfigError(f"mode {mode.name}: no such pipeline: {cost.paper.no_pipeline[mode.peer]}")
    if cost.paper is not None and mode.peer in cost.paper.not_modelled:
        raise ConfigError(f"mode {mode.name}: not modelled: {cost.paper.not_modelled[mode.peer]}")
    if cost.paper is not None and recipe is None:
        raise ConfigError(f"mode {mode.name}: the catalog has no peers.{mode.peer} recipe")
    if recipe is None:
        raise ConfigError(
            f"mode {mode.name} needs a paper-scale cost model (a configs/sim run config): a cost model "
            f"measured from a run has no recipe of the peer to restate"
        )
    return simulate_peer(cost, recipe, iterations=iterations, warmup=warmup, trailing=trailing)


def _rows(sim: _Sim) -> list[dict]:
    """Timeline rows with the keys of ``timeline.jsonl``, plus ``gpus`` and, for overheads
    and the data plane, ``part`` (weights fetch, weights load, trajectory fetch,
    offload/reload, context switch, recompute; the step's all-reduce and AdamW step)."""
    names = [w.spec for w in sorted(sim.workers.values(), key=lambda w: w.index)]
    roles = {w.spec.name: w.role.value for w in sim.workers.values()}
    out = []
    for idx, kind, it, version, s, e, part in sim.rows:
        if idx < 0:
            row = TimelineRow("controller", "cpu", "controller", kind, it, version, s, e, gpus=0)
        else:
            w = names[idx]
            row = TimelineRow(w.name, w.gpu_type, roles[w.name], kind, it, version, s, e, gpus=w.gpus)
        row.part = part or None
        out.append(row.to_json())
    return out


def time_shares(res: SimResult) -> dict[str, float]:
    """Shares of the measured window's GPU-seconds: each overhead ``part``, other busy work
    (``work``) and idle (``idle``)."""
    lo, hi = res.window
    total = res.gpus * (hi - lo)
    shares: dict[str, float] = {}
    for r in res.rows:
        if r["worker"] == "controller":
            continue
        d = max(0.0, min(r["end"], hi) - max(r["start"], lo)) * r["gpus"]
        key = r.get("part") or ("work" if r["kind"] in BUSY_KINDS else "sync")
        shares[key] = shares.get(key, 0.0) + d
    out = {k: v / total for k, v in shares.items()} if total > 0 else {}
    out["idle"] = max(0.0, 1.0 - sum(out.values()))
    return out


def _measure(res: SimResult, sim: _Sim) -> None:
    measure_rows(res)
