"""The reference trainer (``schedule.mode: reference``) and what every mode shares.

One process, one loop, the correctness oracle of every other mode::

    for iteration k:  prompts -> generate groups (version k) -> decode -> reward
                      -> advantages -> gradient of K timesteps per trajectory -> AdamW step

Shared with the distributed controller: building the policy and reward from the config, the
prompt-embedding cache, run-directory handling (checkpoints, resume) and the metrics row.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from digen.config import Config
from digen.errors import CheckpointError, JobCancelled
from digen.evaluation import evaluate_inline, evaluates, held_out_prompts, progress_row
from digen.iteration import IterationBook
from digen.models import load_policy
from digen.models.base import FlowPolicy, PromptEmbeds
from digen.optim import ParameterStore
from digen.rewards import build_rewards
from digen.rollout import Trajectories, generate_group, plan_groups
from digen.rundir import RunDir
from digen.startup import phase
from digen.training import train_group
from digen.viz import write_sample_grid

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}

ProgressFn = Callable[[dict], None]


def build_policy(cfg: Config, device: str | None = None) -> FlowPolicy:
    """Load ``model.path`` with diffusers and wrap LoRA as configured."""
    m = cfg.model
    policy = load_policy(
        cfg.resolve_path(m.path),
        height=m.resolution,
        width=m.resolution,
        dtype=DTYPES[m.dtype],
        device=device or m.device,
        num_frames=m.num_frames,
        max_sequence_length=m.max_sequence_length,
    )
    if m.lora.enabled:
        policy.enable_lora(m.lora.rank, m.lora.alpha, m.lora.target_modules)
    else:
        policy.transformer.requires_grad_(True)
    return policy


def build_reward(cfg: Config, device: str | None = None):
    """The configured reward; model-based rewards load on ``device`` (default ``model.device``)."""
    return build_rewards([spec.model_dump() for spec in cfg.reward], device=device or cfg.model.device)


class EmbedCache:
    """Prompt embeddings, computed once per prompt (text encoders are frozen)."""

    def __init__(self, policy: FlowPolicy, with_uncond: bool):
        self.policy, self.with_uncond, self._cache = policy, with_uncond, {}

    def __call__(self, prompt: str) -> PromptEmbeds:
        if prompt not in self._cache:
            self._cache[prompt] = self.policy.encode_prompts([prompt], with_uncond=self.with_uncond)
        return self._cache[prompt]


@dataclass
class Resumed:
    store: ParameterStore  # or a ShardedStore (train.fsdp), which quacks like one
    start_iteration: int
    previous_weights: dict[str, torch.Tensor] | None


def open_store(
    cfg: Config,
    run: RunDir,
    initial: Callable[[], dict[str, torch.Tensor]],
    resume: bool,
    store_type: type = ParameterStore,
) -> Resumed:
    """A fresh parameter store of the trained tensors ``initial()`` returns (the policy's
    ``trainable_state_dict``; called only when not resuming), or the newest checkpoint's.
    ``store_type`` (``fresh(weights, train)``, ``load(folder, train)``) is the kind of store:
    the controller of an FSDP job keeps only the weights (no optimizer state)."""
    if resume:
        ckpt = run.latest_checkpoint()
        if ckpt is None:
            raise CheckpointError(f"--resume: {run.root} has no checkpoint yet; start without --resume")
        store, state = store_type.load(ckpt, cfg.train)
        prev = None
        if (ckpt / "previous_weights.safetensors").exists():
            from safetensors.torch import load_file

            prev = load_file(str(ckpt / "previous_weights.safetensors"))
        last = int(state["iteration"])
        run.truncate_after(last)
        return Resumed(store, last + 1, prev)
    return Resumed(store_type.fresh(initial(), cfg.train), 0, None)


def save_checkpoint(
    run: RunDir,
    store: ParameterStore,
    iteration: int,
    previous_weights: dict[str, torch.Tensor] | None = None,
) -> None:
    """State after ``iteration``'s step (plus the version before, which a staleness-1 rollout
    of the next iteration uses)."""
    folder = run.checkpoint_dir(iteration)
    tmp = folder.with_name(folder.name + ".tmp")
    if previous_weights is not None:
        from safetensors.torch import save_file

        tmp.mkdir(parents=True, exist_ok=True)
        save_file(
            {k: v.contiguous() for k, v in previous_weights.items()},
            str(tmp / "previous_weights.safetensors"),
        )
    store.save(tmp, {"iteration": iteration})
    if folder.exists():
        import shutil

        shutil.rmtree(folder)
    tmp.rename(folder)
    run.prune_checkpoints()


def busy_seconds(events: list[dict], start: float | None = None, end: float | None = None) -> float:
    """Worker-seconds of non-``sync`` task time within ``[start, end]`` (unbounded when None):
    each event counts by its overlap with the window, whatever iteration it belongs to, so a
    task straddling an iteration boundary (GAP, staleness 1) counts on both sides, as
    :func:`digen.bench.worker_stats` clips it."""
    lo, hi = float("-inf") if start is None else start, float("inf") if end is None else end
    return sum(max(0.0, min(e["end"], hi) - max(e["start"], lo)) for e in events if e["kind"] != "sync")


def timing_metrics(
    events: list[dict], workers: int, wall_s: float, samples: int, window: tuple[float, float] | None = None
) -> dict:
    """``wall_s``, ``samples_per_s`` and the bubble ratio of one iteration's timeline; with
    ``window`` (start, end), busy time is the events' overlap with it (:func:`busy_seconds`)."""
    busy = busy_seconds(events, *(window or (None, None)))
    worker_s = workers * wall_s
    return {
        "wall_s": wall_s,
        "samples_per_s": samples / wall_s if wall_s > 0 else 0.0,
        "busy_s": busy,
        "worker_s": worker_s,
        "bubble_ratio": max(0.0, 1 - busy / worker_s) if worker_s > 0 else 0.0,
    }


@contextmanager
def compute_threads(cfg: Config) -> Iterator[None]:
    """Run the block with ``cluster.local.threads_per_worker`` intra-op CPU threads (the
    count before is restored after).

    A CPU matmul, convolution or norm splits its sums across threads, so its float result
    depends on the thread count (measured on the digits model: a reward 1.8e-7 apart at 1 and
    2 threads). Every process that computes a float of a run uses this one count: the
    reference loop, each worker loop (:func:`workers.loop.worker_loop`) and the controller's
    optimizer step. With the same count, the same batches and the same summation order, the
    synchronous modes compute the reference's bits (docs: README "bit for bit").
    """
    before = torch.get_num_threads()
    torch.set_num_threads(cfg.cluster.local.threads_per_worker)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_reference(
    cfg: Config,
    out: Path,
    *,
    resume: bool = False,
    progress: ProgressFn | None = None,
    cancelled: Callable[[], bool] | None = None,
) -> dict:
    """Train with the single-process reference loop; returns ``summary.json``'s contents.
    ``cancelled()`` is checked before each task: true, the run stops with
    :class:`JobCancelled`, its last complete iteration's checkpoint kept.

    It computes with one worker's thread count (:func:`compute_threads`): it is the oracle of
    the distributed modes, whose workers compute with that count."""
    with compute_threads(cfg):
        return _reference_loop(cfg, out, resume=resume, progress=progress, cancelled=cancelled)


def _reference_loop(
    cfg: Config,
    out: Path,
    *,
    resume: bool,
    progress: ProgressFn | None,
    cancelled: Callable[[], bool] | None,
) -> dict:
    def check_cancel(k: int) -> None:
        if cancelled is not None and cancelled():
            ckpt = run.latest_checkpoint()
            kept = f"the checkpoint {ckpt} is kept" if ckpt is not None else "no iteration had finished"
            raise JobCancelled(f"run cancelled during iteration {k}; {kept}: continue it with --resume")

    torch.manual_seed(cfg.seed)  # nothing should draw from it; set for third-party code
    run = RunDir(out, cfg, resume=resume)
    with phase("model load"):
        policy = build_policy(cfg)
    reward = build_reward(cfg)
    prompts = cfg.prompt_list()
    embed = EmbedCache(policy, cfg.rollout.guidance_scale > 1.0)
    state = open_store(cfg, run, policy.trainable_state_dict, resume)
    store = state.store
    policy.load_trainable_state_dict(store.weights())
    tsp = bool(cfg.schedule.resolved().tsp)
    held_out = held_out_prompts(cfg) if cfg.eval.every else []
    worker = {"worker": "reference", "gpu_type": cfg.cluster.local.gpu_type, "role": "reference"}

    for k in range(state.start_iteration, cfg.iterations):
        t_start = time.time()
        events: list[dict] = []

        def timer(kind: str, s: float, e: float, _k: int = k, _events: list[dict] = events) -> None:
            _events.append(
                {**worker, "kind": kind, "iteration": _k, "version": store.version, "start": s, "end": e}
            )

        groups = plan_groups(cfg, prompts, k, version=store.version)
        book = IterationBook(cfg, k, groups)
        trajs: dict[int, Trajectories] = {}
        for task in groups:
            check_cancel(k)
            traj = generate_group(policy, task, cfg, reward, embeds=embed(task.prompt), timer=timer)
            trajs[task.group] = traj
            book.add_rewards(task.group, traj.rewards)
        for g in book.trainable_groups():
            check_cancel(k)
            spec = book.train_spec(g)
            t0 = time.time()
            traj = trajs[g]
            grads, stats = train_group(
                policy, spec, traj.latents, traj.log_probs, traj.sigmas, embed(groups[g].prompt), cfg, tsp=tsp
            )
            timer("train", t0, time.time())
            book.add_gradient(g, grads, stats)
        t0 = time.time()
        grad, rows = book.gradient()
        opt_stats = store.step(grad, rows)
        policy.load_trainable_state_dict(store.weights())
        timer("optim", t0, time.time())

        metrics = book.metrics()
        metrics.update(opt_stats)
        metrics.update(timing_metrics(events, 1, time.time() - t_start, metrics["samples"]))
        metrics.update({"policy_version": store.version, "max_staleness": 0})
        run.append("timeline.jsonl", events)
        run.append("metrics.jsonl", [metrics])
        if cfg.output.sample_grid_every and (
            k % cfg.output.sample_grid_every == 0 or k == cfg.iterations - 1
        ):
            write_sample_grid(run.samples / f"iter_{k:04d}.png", trajs, groups)
        if (k + 1) % cfg.output.checkpoint_every == 0 or k == cfg.iterations - 1:
            save_checkpoint(run, store, k)
        if progress is not None:
            progress(metrics)
        if held_out and evaluates(cfg, k):  # the weights of version k + 1 are loaded
            row = evaluate_inline(policy, cfg, reward, run, held_out, k)
            if progress is not None:
                progress(progress_row(row))
    return run.write_summary("reference")
