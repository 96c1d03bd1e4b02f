"""What a worker does with each kind of task, and where the task's tensors go.

A generation task keeps its group's tensors (latents, log-probs, images, rewards; the decoded
float images too when a ``reward`` task scores them) as a blob in this worker's store and
returns their address with the rewards and timings: the trainer that trains the group, or the
reward worker that scores it, fetches them from here (:mod:`digen.dataplane.blobs`). A train
task fetches its group's trajectories from wherever they were generated and computes the
gradient; a trainer adds it into its running sum once its acknowledgement won
(:mod:`digen.workers.trainer`), any other worker (a rollout worker training under RAT), or every
worker when the task says ``keep_gradient`` (the controller's reading of ``train.reduce:
exact``), keeps it as a blob the trainers fetch at the step. An
``eval`` task returns its scores and its images as grid cells (a small PNG).

A task whose input is gone (the worker holding it died) is *parked*, not failed: the
controller has the input made again and then re-posts the task (:meth:`TaskQueue.park`).

Each runner returns ``(result, after)``: the result to acknowledge, and what to do once the
acknowledgement won (None: nothing), or None when the task was parked.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from digen.controlplane.messages import (
    BlobRef,
    EvalChunkResult,
    GenResult,
    Result,
    RewardResult,
    TrainResult,
)
from digen.controlplane.payloads import EvalPayload, GenPayload, RewardPayload, TrainEntry, TrainPayload
from digen.controlplane.queue import LeasedTask
from digen.core import blobnames
from digen.core.events import Role, TaskKind, TaskRef, work_share
from digen.core.timeline import TimelineRow
from digen.dataplane.blobs import BlobLost, BlobMismatch, Expect, fetch
from digen.dataplane.wire import on_host
from digen.errors import PayloadError
from digen.evaluator import evaluate_chunk
from digen.rollout import Trajectories, batch_key, generate_group, generate_groups, score_group
from digen.testing import faults
from digen.training import train_groups
from digen.viz import image_cells, to_png
from digen.workers.context import WorkerContext, event

log = logging.getLogger(__name__)

Outcome = tuple[Result, Callable[[], None] | None] | None


def generate(ctx: WorkerContext, leased: LeasedTask, role: Role, *, score: bool, stop) -> tuple:
    """A generation task's group and timeline events (scored when ``score``), nothing stored:
    ``(trajectories, events, start)``. Also what every rank of a sequence-parallel replica runs."""
    task = GenPayload.read(leased.payload).task
    ref = TaskRef(TaskKind.GEN, task.iteration, task.group)
    t0 = time.time()
    ctx.ensure_version(task.version)
    events: list[TimelineRow] = []
    if time.time() - t0 > 1e-3:
        events.append(event(ctx, role, "sync", ref, task.version, t0, time.time()))
    reward_fn = ctx.ensure_reward()
    assert ctx.embed is not None

    def timer(kind: str, s: float, e: float, cpu_s: float) -> None:
        events.append(event(ctx, role, kind, ref, task.version, s, e, cpu_s))

    reward = reward_fn if score else None  # else a reward task scores
    traj = generate_group(
        ctx.ensure_policy(), task, ctx.cfg, reward, embeds=ctx.embed(task.prompt), timer=timer, stop=stop
    )
    faults.point("gen", ctx.job, ctx.name, task=leased.task_id, iteration=task.iteration)
    return traj, events, t0


def gen_result(
    ctx: WorkerContext, leased: LeasedTask, traj: Trajectories, events: list[TimelineRow], t0: float
) -> GenResult:
    """Keep a generated group's tensors as a blob of this worker; the task's result: rewards,
    timings, where the blob is, and (when the payload asks, for a sample grid) its images as
    grid cells."""
    payload = GenPayload.read(leased.payload)
    version = payload.task.version
    name = blobnames.trajectories(ctx.job.job_id, leased.task_id)
    blob = ctx.blobs.put(name, traj.tensors(), {"version": str(version)})
    return GenResult(
        worker=ctx.name,
        start=t0,
        end=time.time(),
        events=events,
        rewards=[float(x) for x in traj.rewards],
        blob=BlobRef(ctx.blob_addr, name, blob.digest, nbytes=blob.nbytes),
        # train.multi_reward per_reward or gdpo
        reward_parts=None if traj.reward_parts is None else traj.reward_parts.tolist(),
        cells=to_png(image_cells(traj.images)) if payload.grid else None,
    )


def run_gen(ctx: WorkerContext, leased: LeasedTask, role: Role) -> Outcome:
    score = GenPayload.read(leased.payload).score
    traj, events, t0 = generate(ctx, leased, role, score=score, stop=ctx.job_stopped)
    return gen_result(ctx, leased, traj, events, t0), None


def gen_batches(ctx: WorkerContext, batch: list[LeasedTask]) -> list[list[LeasedTask]]:
    """Leased generation tasks cut into the batches that can run as one forward, in lease
    order: those of one iteration, weights version and scoring (inline or by a ``reward``
    task) whose prompt embeddings agree in shape (:func:`digen.rollout.batch_key`)."""
    assert ctx.embed is not None
    out: dict[tuple, list[LeasedTask]] = {}
    for leased in batch:
        try:
            payload = GenPayload.read(leased.payload)
        except PayloadError:  # a batch of its own, which fails on its own (run_gen_batch reads it again)
            out[("unreadable", leased.task_id)] = [leased]
            continue
        task = payload.task
        key = (task.iteration, task.version, payload.score, batch_key(ctx.embed(task.prompt)))
        out.setdefault(key, []).append(leased)
    return list(out.values())


def run_gen_batch(ctx: WorkerContext, batch: list[LeasedTask], role: Role, stop) -> list[Outcome]:
    """Generation tasks that :func:`gen_batches` put together, as one batch
    (:func:`digen.rollout.generate_groups`: one forward per denoising step for all their
    samples); each task's result on its own, as :func:`run_gen` makes it, its ``gen`` event
    carrying ``batch`` (the groups of the forward)."""
    payloads = [GenPayload.read(x.payload) for x in batch]
    tasks = [p.task for p in payloads]
    version = tasks[0].version
    t0 = time.time()
    ctx.ensure_version(version)
    events: list[list[TimelineRow]] = [[] for _ in batch]
    if time.time() - t0 > 1e-3:
        ref = TaskRef(TaskKind.GEN, tasks[0].iteration, tasks[0].group)
        events[0].append(event(ctx, role, "sync", ref, version, t0, time.time()))
    reward_fn = ctx.ensure_reward()
    assert ctx.embed is not None

    def timer_of(j: int):
        ref = TaskRef(TaskKind.GEN, tasks[j].iteration, tasks[j].group)

        def timer(kind: str, s: float, e: float, cpu_s: float) -> None:
            row = event(ctx, role, kind, ref, version, s, e, cpu_s)
            if kind == "gen":
                row.batch = len(batch)
            events[j].append(row)

        return timer

    reward = reward_fn if payloads[0].score else None  # else a reward task scores
    embeds = ctx.embed.many([t.prompt for t in tasks])
    trajs = generate_groups(
        ctx.ensure_policy(), tasks, ctx.cfg, reward, embeds, [timer_of(j) for j in range(len(batch))], stop
    )
    out: list[Outcome] = []
    for j, (leased, traj, evs) in enumerate(zip(batch, trajs, events, strict=True)):
        faults.point("gen", ctx.job, ctx.name, task=leased.task_id, iteration=traj.task.iteration)
        result = gen_result(ctx, leased, traj, evs, t0)
        if len(batch) > 1:  # the task's own share of the batch: the seconds per group TAG/RAT learn
            result.start = t0 if j == 0 else evs[0].start
            result.end = result.start + sum(e.end - e.start for e in evs)
        out.append((result, None))
    return out


TRAINING_TENSORS = None
"""What a train task fetches of its group: every tensor the trajectory holds (each algorithm's
trajectory holds what its loss needs, :mod:`digen.algos.registry`) but the images."""
NOT_TRAINED = ("images", "decoded")


def group_tensors(
    ctx: WorkerContext, leased: LeasedTask, src: BlobRef | None, names: list[str] | None
) -> dict[str, torch.Tensor]:
    """Tensors ``names`` of the generated group a task works on (None: all but
    :data:`NOT_TRAINED`), from the worker that made it (this one: no copy; the payload's
    ``src`` says where, and the digest and version the controller counted). :class:`BlobLost`
    when it is not stored (being generated again), its worker is gone, or what answers is not
    that blob (:class:`~digen.dataplane.blobs.BlobMismatch`)."""
    ref = TaskRef.parse(leased.task_id)
    faults.point("fetch", ctx.job, ctx.name, task=leased.task_id, iteration=ref.iteration)
    return source_tensors(ctx, src, ref.iteration, ref.group, names)


def source_tensors(
    ctx: WorkerContext, src: BlobRef | None, iteration: int, group: int, names: list[str] | None
) -> dict[str, torch.Tensor]:
    """:func:`group_tensors` of one group whose trajectories are at ``src``."""
    if src is None:
        raise BlobLost(f"the trajectories of group {group} of iteration {iteration} are not stored")
    addr, name, digest, version = src.addr, src.name, src.digest or None, src.version
    if addr == ctx.blob_addr:
        own = ctx.blobs.get(name)
        if own is None:
            raise BlobLost(f"{name}: this worker no longer holds it")
        if digest is not None and own.digest != digest:
            raise BlobLost(f"{name}: this worker holds another blob under that name (made again)")
        keep = names if names is not None else [k for k in own.tensors if k not in NOT_TRAINED]
        return {k: own.tensors[k] for k in keep}
    expect = Expect(digest=digest, version=version)
    return fetch(addr, name, names=names, exclude=NOT_TRAINED if names is None else (), expect=expect)[0]


def park(ctx: WorkerContext, leased: LeasedTask, exc: BlobLost) -> None:
    # a mismatch was already the one warning (naming its producer) where the fetch found it
    level = logging.INFO if isinstance(exc, BlobMismatch) else logging.WARNING
    log.log(level, "task %s on %s waits for its input: %s", leased.task_id, ctx.name, exc)
    ctx.queue.park(leased.task_id, worker=ctx.name, why=f"BlobLost: {exc}")


def batch_specs(task_id: str, payload: TrainPayload) -> list[TrainEntry]:
    """A train task's groups (:meth:`~digen.controlplane.payloads.TrainPayload.entries`: its
    first group and, for a batched task, ``train.groups_per_task``, the others), checked to
    be the task's: its iteration, and consecutive groups from the one that names it
    (:class:`~digen.errors.PayloadError` otherwise: a payload read from Redis is not trusted)."""
    ref = TaskRef.parse(task_id)
    entries = payload.entries()
    got = [(e.spec.iteration, e.spec.group) for e in entries]
    if got != [(ref.iteration, ref.group + i) for i in range(len(entries))]:
        raise PayloadError(
            f"train task {task_id} carries groups {got}, not its own consecutive groups from {ref.group}"
        )
    return entries


def batch_tensors(
    ctx: WorkerContext, leased: LeasedTask, entries: list[TrainEntry], names: list[str] | None
) -> list[dict[str, torch.Tensor]]:
    """:func:`group_tensors` of every group of a (batched) train task, in group order."""
    first = group_tensors(ctx, leased, entries[0].source, names)
    rest = [source_tensors(ctx, e.source, e.spec.iteration, e.spec.group, names) for e in entries[1:]]
    return [first, *rest]


def run_train(ctx: WorkerContext, leased: LeasedTask, role: Role) -> Outcome:
    payload = TrainPayload.read(leased.payload)
    entries = batch_specs(leased.task_id, payload)
    specs = [e.spec for e in entries]
    spec, ref = specs[0], TaskRef.parse(leased.task_id)
    version = payload.version  # mini-batch m of iteration i: digen.core.versions.version
    t0 = time.time()
    ctx.ensure_version(version)
    events: list[TimelineRow] = []
    if time.time() - t0 > 1e-3:
        events.append(event(ctx, role, "sync", ref, version, t0, time.time()))
    try:
        data = batch_tensors(ctx, leased, entries, TRAINING_TENSORS)
    except BlobLost as exc:
        park(ctx, leased, exc)
        return None
    assert ctx.embed is not None
    t1, c1 = time.time(), time.thread_time()
    embeds = [ctx.embed(e.prompt) for e in entries]
    grads, stats = train_groups(ctx.ensure_policy(), specs, data, embeds, ctx.cfg, tsp=payload.tsp)
    cpu_s = time.thread_time() - c1
    faults.point("train", ctx.job, ctx.name, task=leased.task_id, iteration=spec.iteration)
    events.append(event(ctx, role, "train", ref, version, t1, time.time(), cpu_s))
    if ref.part is not None or len(specs) > 1:  # not one whole group: the bench counts its share so
        samples = ctx.cfg.train.mini_batch_split == "samples"
        events[-1].share = work_share(ref, len(specs), ctx.cfg.train.mini_batches, samples)
    result = TrainResult(worker=ctx.name, start=t0, end=time.time(), events=events, stats=stats)
    member = ctx.member
    if member is None or payload.keep_gradient:  # the trainers fetch it at the step
        name = blobnames.gradient(ctx.job.job_id, leased.task_id)
        blob = ctx.blobs.put(name, on_host(grads))  # served from the host, not from GPU memory
        result.grad = BlobRef(ctx.blob_addr, name, blob.digest)
        return result, None
    return result, lambda: member.add(leased.task_id, grads)


def run_reward(ctx: WorkerContext, leased: LeasedTask, role: Role) -> Outcome:
    """Score a generated group from its decoded images (the same float32 tensor the
    generation task would have scored inline, so the rewards are the same)."""
    payload = RewardPayload.read(leased.payload)
    task = payload.task
    ref = TaskRef(TaskKind.REWARD, task.iteration, task.group)
    t0 = time.time()
    try:
        decoded = group_tensors(ctx, leased, payload.source, ["decoded"])["decoded"]
    except BlobLost as exc:
        park(ctx, leased, exc)
        return None
    reward_fn = ctx.ensure_reward()
    t1, c1 = time.time(), time.thread_time()
    rewards, parts = score_group(reward_fn, decoded, task.prompt, ctx.cfg)
    t2 = time.time()
    events = [event(ctx, role, "reward", ref, task.version, t1, t2, time.thread_time() - c1)]
    result = RewardResult(
        worker=ctx.name,
        start=t0,
        end=t2,
        events=events,
        rewards=[float(x) for x in rewards],
        reward_parts=None if parts is None else parts.tolist(),  # train.multi_reward per_reward or gdpo
    )
    return result, None


def run_eval(ctx: WorkerContext, leased: LeasedTask, role: Role) -> tuple[Result, None]:
    """Sample and score a chunk of held-out prompts with the version the task names; the
    result holds the scores and the images as grid cells. It reads no peer's blob, so it is
    never parked: always a result, with nothing to run after its acknowledgement."""
    task = EvalPayload.read(leased.payload).task
    ref = TaskRef.parse(leased.task_id)
    t0 = time.time()
    ctx.ensure_version(task.version)
    reward_fn = ctx.ensure_reward()
    t1 = time.time()
    res = evaluate_chunk(ctx.ensure_policy(), task, ctx.cfg, reward_fn, embed=ctx.embed)
    t2 = time.time()
    events = [event(ctx, role, "eval", ref, task.version, t1, t2)]
    if t1 - t0 > 1e-3:
        events.insert(0, event(ctx, role, "sync", ref, task.version, t0, t1))
    result = EvalChunkResult(
        worker=ctx.name,
        start=t0,
        end=t2,
        events=events,
        scores={k: [float(x) for x in v] for k, v in res.scores.items()},
        cells=to_png(res.cells),
    )
    return result, None


RUNNERS = {
    TaskKind.GEN.value: run_gen,
    TaskKind.TRAIN.value: run_train,
    TaskKind.REWARD.value: run_reward,
    TaskKind.EVAL.value: run_eval,
}
"""Queue name -> the function that runs its tasks."""
