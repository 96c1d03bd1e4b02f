"""The long-lived worker loop: pull tasks by role tag, run them, acknowledge.

The controller places one loop per Dask worker (``client.submit(worker_loop, ...,
workers=[addr])``). The loop loads the policy once, then repeats: read this worker's role tag
from Redis -> lease a task from the queues :func:`digen.core.policy.pull_order` names ->
load the weights version the task asks for -> run it -> store its data and acknowledge. It
returns when the job's status leaves ``running``.

A generation task produces ``data:<id>`` (latents, log-probs, images, rewards) and a result
with the rewards and timings; a train task reads its group's data and produces the gradient.
With reward workers a generation task leaves the scoring to a ``reward`` task (its decoded
float images travel in ``data:<gen id>`` as safetensors), which returns the rewards; an
``eval`` task samples held-out prompts (:mod:`digen.evaluation`) and returns their scores and
images (``data:<eval id>``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field

import redis
import torch

from digen.assembly import EmbedCache, build_reward
from digen.config import Config
from digen.core.events import Role, TaskKind, TaskRef
from digen.core.policy import idle_kinds, pull_order
from digen.errors import TaskDropped
from digen.evaluation import EvalTask, evaluate_chunk
from digen.rewards.base import call_reward
from digen.rewards.http import share_breakers
from digen.rollout import GroupTask, generate_group
from digen.runtime.jobstate import JobState
from digen.runtime.queue import LeasedTask, TaskQueue
from digen.runtime.redis_conn import RoundTrips, connect, count_round_trips
from digen.startup import process_start_time
from digen.testing import faults
from digen.training import TrainSpec, train_group
from workers.preload import LOAD_TIMES, take_policy, worker_device

log = logging.getLogger(__name__)
STOP_CHECK_S = 0.2
"""How often, at most, a running generation task reads the job's status (one GET)."""


@dataclass
class WorkerRuntime:
    """What one worker holds between tasks."""

    name: str
    gpu_type: str
    cfg: Config
    queue: TaskQueue
    job: JobState
    device: str
    policy: object = None
    reward: object = None
    embed: EmbedCache | None = None
    version: int | None = None
    weights_cache: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    tasks_run: int = 0
    round_trips: RoundTrips | None = None
    """Requests this loop has sent to Redis (reported on each task's last timeline event)."""
    cycles: int = 0
    """Passes through the loop (one per leased task, plus idle ones)."""
    reported: tuple[int, int] = (0, 0)
    """(round_trips, cycles) at the last report."""
    stop_checked: float = 0.0

    def ensure_reward(self) -> None:
        """Build the config's reward once per worker, on the worker's device."""
        if self.reward is None:
            self.reward = build_reward(self.cfg, device=self.device)

    def job_stopped(self) -> bool:
        """True once the job left ``running`` (``digen cancel``): read at most every
        :data:`STOP_CHECK_S`, between denoising steps (:func:`~digen.rollout.generate_group`)."""
        now = time.monotonic()
        if now - self.stop_checked < STOP_CHECK_S:
            return False
        self.stop_checked = now
        return self.job.status() != "running"

    def report_redis(self, events: list[dict]) -> None:
        """Mark the task's last event with the round trips and loop cycles since the last task,
        for ``digen bench`` (:func:`digen.bench.worker_stats`)."""
        if self.round_trips is None or not events:
            return
        now = (self.round_trips.count, self.cycles)
        events[-1]["redis_round_trips"], events[-1]["cycles"] = (
            now[0] - self.reported[0],
            now[1] - self.reported[1],
        )
        self.reported = now

    def ensure_policy(self):
        if self.policy is None:
            self.policy = take_policy(self.cfg, self.device)  # preloaded, or built now
            self.embed = EmbedCache(self.policy, self.cfg.rollout.guidance_scale > 1.0)
        return self.policy

    def ensure_version(self, version: int) -> None:
        """Load weights ``version`` into the policy (a no-op when already loaded)."""
        policy = self.ensure_policy()
        if self.version == version:
            return
        weights = self.weights_cache.get(version)
        if weights is None:
            deadline = time.monotonic() + 60
            while (weights := self.job.weights(version)) is None:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"weights version {version} never appeared in Redis")
                time.sleep(0.01)
            self.weights_cache = {v: w for v, w in self.weights_cache.items() if v >= version - 1}
            self.weights_cache[version] = weights
            faults.point("sync", self.job, self.name, task=f"weights:{version}", iteration=version)
        policy.load_trainable_state_dict(weights)
        self.version = version


def _event(rt: WorkerRuntime, role: Role, kind: str, task: TaskRef, version: int, s: float, e: float) -> dict:
    return {
        "worker": rt.name,
        "gpu_type": rt.gpu_type,
        "role": role.value,
        "kind": kind,
        "iteration": task.iteration,
        "version": version,
        "start": s,
        "end": e,
    }


def generate(rt: WorkerRuntime, leased: LeasedTask, role: Role, *, score: bool, stop) -> tuple:
    """A generation task's group and timeline events (scored when ``score``), nothing stored:
    ``(trajectories, events, start)``. Also what every rank of a sequence-parallel replica runs."""
    task = GroupTask.from_json(leased.payload["task"])
    ref = TaskRef(TaskKind.GEN, task.iteration, task.group)
    t0 = time.time()
    rt.ensure_version(task.version)
    events = []
    if time.time() - t0 > 1e-3:
        events.append(_event(rt, role, "sync", ref, task.version, t0, time.time()))
    rt.ensure_reward()
    assert rt.embed is not None

    def timer(kind: str, s: float, e: float) -> None:
        events.append(_event(rt, role, kind, ref, task.version, s, e))

    reward = rt.reward if score else None  # else a reward task scores
    traj = generate_group(
        rt.policy, task, rt.cfg, reward, embeds=rt.embed(task.prompt), timer=timer, stop=stop
    )
    faults.point("gen", rt.job, rt.name, task=leased.task_id, iteration=task.iteration)
    return traj, events, t0


def gen_result(rt: WorkerRuntime, leased: LeasedTask, traj, events: list[dict], t0: float) -> dict:
    """Store a generated group's data; the task's result."""
    version = GroupTask.from_json(leased.payload["task"]).version
    rt.job.put_data(leased.task_id, traj.tensors(), {"version": str(version)})
    return {
        "rewards": [float(x) for x in traj.rewards],
        "events": events,
        "worker": rt.name,
        "start": t0,
        "end": time.time(),
    }


def run_gen(rt: WorkerRuntime, leased: LeasedTask, role: Role) -> dict:
    score = leased.payload.get("score", True)
    traj, events, t0 = generate(rt, leased, role, score=score, stop=rt.job_stopped)
    return gen_result(rt, leased, traj, events, t0)


def run_train(rt: WorkerRuntime, leased: LeasedTask, role: Role) -> dict:
    spec = TrainSpec.from_json(leased.payload["spec"])
    ref = TaskRef.parse(leased.task_id)
    t0 = time.time()
    rt.ensure_version(spec.iteration)  # iteration i trains version i
    events = []
    if time.time() - t0 > 1e-3:
        events.append(_event(rt, role, "sync", ref, spec.iteration, t0, time.time()))
    gen_id = TaskRef(TaskKind.GEN, spec.iteration, spec.group).id
    data = rt.job.data(gen_id)
    if data is None:
        raise RuntimeError(f"trajectories of {gen_id} are missing from Redis")
    assert rt.embed is not None
    t1 = time.time()
    grads, stats = train_group(
        rt.policy, spec, data, rt.embed(leased.payload["prompt"]), rt.cfg, tsp=bool(leased.payload["tsp"])
    )
    faults.point("train", rt.job, rt.name, task=leased.task_id, iteration=spec.iteration)
    rt.job.put_data(leased.task_id, grads)
    events.append(_event(rt, role, "train", ref, spec.iteration, t1, time.time()))
    if ref.part is not None:  # half a group (RAT): the bench counts it as such
        events[-1]["share"] = ref.share
    return {"stats": stats.to_json(), "events": events, "worker": rt.name, "start": t0, "end": time.time()}


def run_reward(rt: WorkerRuntime, leased: LeasedTask, role: Role) -> dict:
    """Score a generated group from its decoded images (the same float32 tensor the
    generation task would have scored inline, so the rewards are the same)."""
    task = GroupTask.from_json(leased.payload["task"])
    ref = TaskRef(TaskKind.REWARD, task.iteration, task.group)
    gen_id = TaskRef(TaskKind.GEN, task.iteration, task.group).id
    t0 = time.time()
    data = rt.job.data(gen_id)
    if data is None or "decoded" not in data:
        raise RuntimeError(f"decoded images of {gen_id} are missing from Redis")
    rt.ensure_reward()
    t1 = time.time()
    n = len(task.sample_ids)
    meta = rt.cfg.prompt_metadata(task.prompt)  # GenEval-style datasets: the rewards get it
    rewards = call_reward(rt.reward, data["decoded"], [task.prompt] * n, None if meta is None else [meta] * n)
    rewards = rewards.float().cpu()
    t2 = time.time()
    events = [_event(rt, role, "reward", ref, task.version, t1, t2)]
    return {
        "rewards": [float(x) for x in rewards],
        "events": events,
        "worker": rt.name,
        "start": t0,
        "end": t2,
    }


def run_eval(rt: WorkerRuntime, leased: LeasedTask, role: Role, *, store: bool = True) -> dict:
    """Sample and score a chunk of held-out prompts with the version the task names
    (``store`` False: the images are not written to Redis; a replica's follower ranks)."""
    task = EvalTask.from_json(leased.payload["task"])
    ref = TaskRef.parse(leased.task_id)
    t0 = time.time()
    rt.ensure_version(task.version)
    rt.ensure_reward()
    t1 = time.time()
    res = evaluate_chunk(rt.policy, task, rt.cfg, rt.reward)
    if store:
        rt.job.put_data(leased.task_id, {"images": res.images.contiguous()})
    t2 = time.time()
    events = [_event(rt, role, "eval", ref, task.version, t1, t2)]
    if t1 - t0 > 1e-3:
        events.insert(0, _event(rt, role, "sync", ref, task.version, t0, t1))
    scores = {k: [float(x) for x in v] for k, v in res.scores.items()}
    return {"scores": scores, "events": events, "worker": rt.name, "start": t0, "end": t2}


RUNNERS = {
    TaskKind.GEN.value: run_gen,
    TaskKind.TRAIN.value: run_train,
    TaskKind.REWARD.value: run_reward,
    TaskKind.EVAL.value: run_eval,
}
"""Queue name -> the function that runs its tasks."""


def poll(rt: WorkerRuntime, token: str) -> tuple[Role, int] | None:
    """The top of a loop cycle: the worker's role tag (role, off-role budget), or None when
    the loop must stop (the job left ``running``, or a newer loop took the worker). One round
    trip (:meth:`JobState.loop_state`); waits while the worker has no tag yet."""
    while True:
        state = rt.job.loop_state(rt.name, token)
        if state.status != "running":
            return None
        if not state.owns_loop:
            log.info("worker %s: a newer loop took over; this one stops", rt.name)
            return None
        if state.tag is not None:
            return state.tag
        time.sleep(0.05)


def next_task(rt: WorkerRuntime, role: Role, budget: int) -> LeasedTask | None:
    """Lease by the tag's pull order. A worker takes an off-role task (a trainer: generation,
    TAG; a rollout worker: training, RAT) only when none of its own kind is ready and its
    budget allows (spent atomically in Redis, given back when the queue had nothing)."""
    order = pull_order(role, budget)
    idle = [k.value for k in idle_kinds(role)]  # evaluation: only when nothing else is queued
    if role is Role.COLOCATED or len(order) == 1:
        return rt.queue.lease([k.value for k in order] + idle, rt.name, block_s=0.05)
    own, other = order
    leased = rt.queue.lease([own.value], rt.name, block_s=0.0)
    if leased is not None:
        return leased
    if rt.job.take_budget(rt.name):
        leased = rt.queue.lease([other.value], rt.name, block_s=0.0)
        if leased is not None:
            return leased
        rt.job.return_budget(rt.name)
    return rt.queue.lease([own.value, *idle], rt.name, block_s=0.05)


def worker_loop(
    job_id: str,
    redis_url: str,
    cfg_json: dict,
    name: str | None = None,
    gpu_type: str | None = None,
    device: str | None = None,
    threads: int = 1,
) -> dict:
    """Run tasks of ``job_id`` until the job stops. Returns counts for the controller's log.
    A reward worker (Dask resource ``reward``) loads no policy: it only scores."""
    started = time.time()
    scorer = False
    try:  # inside a Dask worker: mark the task long-running so it does not block the pool
        from distributed import get_worker, secede

        from digen.runtime.cluster import quiet_worker_heartbeat

        w = get_worker()
        quiet_worker_heartbeat()
        secede()
        name = name or str(w.name)
        gpu_type = gpu_type or next((k[4:] for k in w.state.total_resources if k.startswith("gpu-")), "cpu")
        scorer = Role.REWARD.value in w.state.total_resources
    except (ImportError, ValueError):
        pass
    assert name is not None
    torch.set_num_threads(threads)  # cluster.local.threads_per_worker, as the reference (compute_threads)
    cfg = Config.model_validate(cfg_json)
    r = connect(redis_url, outage_s=cfg.schedule.redis_outage_s)  # a Redis restart pauses the loop
    share_breakers(r)  # a reward server one worker found down fails every worker's calls at once
    round_trips = count_round_trips(r)
    rt = WorkerRuntime(
        name=name,
        gpu_type=gpu_type or "cpu",
        cfg=cfg,
        queue=TaskQueue(r, job_id, lease_s=cfg.schedule.lease_s),
        job=JobState(r, job_id),
        device=worker_device(cfg, device),
        round_trips=round_trips,
    )
    token = uuid.uuid4().hex
    rt.job.claim_loop(name, token)  # one loop per worker: an older one stops
    faults.point("start", rt.job, name)
    if not scorer:
        rt.ensure_policy()  # load before taking tasks: a joining worker never stalls a task
    rt.ensure_reward()
    rt.job.note_startup(
        name, {"process": process_start_time(), "loop": started, **LOAD_TIMES, "ready": time.time()}
    )
    rt.job.mark_ready(name, rt.gpu_type)
    log.info("worker %s (%s) joined job %s", name, rt.gpu_type, job_id)
    if cfg.rollout.sequence_parallel > 1 and not scorer:  # a rank of a replica first, if planned so
        from workers.sp_loop import run_sp_rank

        rt.tasks_run += run_sp_rank(rt, token)
    while (tag := poll(rt, token)) is not None:
        rt.cycles += 1
        role, budget = tag
        if cfg.train.fsdp and role is Role.TRAINER:  # a rank of the job's FSDP group from now on
            from workers.fsdp_loop import run_fsdp_rank

            return run_fsdp_rank(rt)
        leased = next_task(rt, role, budget)
        if leased is None:
            continue
        try:
            result = RUNNERS[leased.queue](rt, leased, role)
        except redis.ConnectionError:
            raise  # Redis gone for longer than schedule.redis_outage_s: not the task's fault
        except TaskDropped as exc:  # the job stopped: the loop ends at its next poll
            log.info("worker %s: %s", name, exc)
            continue
        except Exception as exc:  # a failing task is reported, never kills the loop
            log.error("task %s failed on %s: %s", leased.task_id, name, exc)
            rt.queue.nack(
                leased.task_id,
                f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=5)}",
                max_attempts=cfg.schedule.max_attempts,
                worker=name,
            )
            continue
        for e in result["events"]:  # when it left the queue: the bench's eval waits read it
            e["leased"] = leased.leased_at
        rt.report_redis(result["events"])
        faults.point(
            "ack", rt.job, name, task=leased.task_id, iteration=TaskRef.parse(leased.task_id).iteration
        )
        if not rt.queue.ack(leased.task_id, result, worker=name):
            log.info(
                "task %s was already acknowledged (it ran twice); this result is discarded", leased.task_id
            )
        rt.tasks_run += 1
    return {"worker": name, "tasks": rt.tasks_run}


def exit_process() -> None:
    """Run on a worker by the controller (``client.run``) after its loop failed: the process
    exits (just after answering) and its Nanny starts a fresh one: clean imports, a clean device."""
    threading.Timer(0.2, os._exit, args=(1,)).start()
