"""The reference loop (``schedule.mode: reference``): one process, the correctness oracle of
every other mode::

    for iteration k:  prompts -> generate groups (version M k) -> decode -> reward -> advantages
        for mini-batch m in 0 .. M-1 (its groups, or its share of the shuffled samples;
                                     M = train.mini_batches, train.mini_batch_split):
            gradient of K timesteps per trajectory (version M k + m) -> AdamW step

The algorithm (``train.algorithm``) is the library's: :func:`generate_group` runs its rollout
plan, :func:`train_groups` its rows and loss, the store keeps its state (each version loaded
with :func:`digen.algos.state.load_version`).

It builds its parts as every mode does (:mod:`digen.assembly`) and keeps the books and
writes the run directory with the code the distributed controller uses
(:mod:`digen.iteration`, :mod:`digen.optim`, :mod:`digen.rundir`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from digen.assembly import build_policy, build_reward, compute_threads
from digen.config import Config
from digen.core.timeline import TimelineRow
from digen.errors import JobCancelled
from digen.evaluation import carries_ema, evaluates, held_out_prompts, progress_row
from digen.evaluator import evaluate_inline
from digen.iteration import (
    IterationBook,
    IterationEnd,
    ProgressFn,
    checkpoints,
    draws_grid,
    finish_iteration,
    within_iteration,
)
from digen.optim import open_store, save_checkpoint
from digen.prompt_cache import EmbedCache
from digen.rollout import Trajectories, generate_group
from digen.rundir import RunDir
from digen.startup import phase
from digen.task_records import plan_groups
from digen.training import train_groups
from digen.viz import GridRow, image_cells


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

    run = RunDir(out, cfg, resume=resume)
    with phase("model load"):
        policy = build_policy(cfg)
    reward = build_reward(cfg)
    prompts = cfg.prompt_list()
    embed = EmbedCache.for_config(policy, cfg)
    # AdamW on the model's device, as every trainer of a distributed job runs it
    state = open_store(cfg, run, policy.trainable_state_dict, resume, device=str(policy.device))
    store = state.store
    store.load_into(policy, ema=carries_ema(cfg, store.version))
    if resume:  # the checkpoint's weights fit the policy: now the run directory may change
        resumed = run.resumed(state.start_iteration - 1)
        if progress is not None:
            progress(resumed)
    tsp = bool(cfg.schedule.resolved().tsp)
    held_out = held_out_prompts(cfg) if cfg.eval.every else []
    gpu_type = cfg.cluster.local.gpu_type

    for k in range(state.start_iteration, cfg.iterations):
        t_start = time.time()
        events: list[dict] = []

        def timer(
            kind: str, s: float, e: float, cpu_s: float, _k: int = k, _events: list[dict] = events
        ) -> None:
            row = TimelineRow("reference", gpu_type, "reference", kind, _k, store.version, s, e, cpu_s=cpu_s)
            _events.append(row.to_json())

        groups = plan_groups(cfg, prompts, k, version=store.version)
        book = IterationBook(cfg, k, groups)
        trajs: dict[int, Trajectories] = {}
        for task in groups:
            check_cancel(k)
            traj = generate_group(policy, task, cfg, reward, embeds=embed(task.prompt), timer=timer)
            trajs[task.group] = traj
            parts = None if traj.reward_parts is None else traj.reward_parts.tolist()
            book.add_rewards(task.group, traj.rewards.tolist(), parts)
            if progress is not None:
                progress(within_iteration(book))
        norms = []
        for m in range(cfg.train.mini_batches):  # one optimizer step per mini-batch
            for g, part in mini_batch_tasks(book, m):
                check_cancel(k)
                specs = book.task_specs(g, part)  # its groups (train.groups_per_task)
                if not any(x.samples for x in specs):  # none of its samples is in this mini-batch
                    continue
                t0, c0 = time.time(), time.thread_time()
                grads, stats = train_groups(
                    policy,
                    specs,
                    [trajs[x.group].tensors() for x in specs],
                    [embed(groups[x.group].prompt) for x in specs],
                    cfg,
                    tsp=tsp,
                )
                timer("train", t0, time.time(), time.thread_time() - c0)
                # the book holds every task's gradient until the step (it sums them in group
                # order): on the host, not in the GPU memory the next forward needs
                book.add_gradient(g, {k: v.to("cpu") for k, v in grads.items()}, stats, part)
                if progress is not None:
                    progress(within_iteration(book))
            t0, c0 = time.time(), time.thread_time()
            grad, rows = book.gradient(m)
            last = m == cfg.train.mini_batches - 1
            norms.append(store.step(grad, rows, last_of_iteration=last)["grad_norm"])
            store.load_into(policy, ema=carries_ema(cfg, store.version))
            timer("optim", t0, time.time(), time.thread_time() - c0)
        step_stats: dict = {"grad_norm": norms[0] if len(norms) == 1 else sum(norms) / len(norms)}
        if len(norms) > 1:  # one per optimizer step
            step_stats["grad_norms"] = norms
        grid = None
        if draws_grid(cfg, k):
            grid = [
                GridRow(
                    g, t.task.prompt, t.task.version, [float(x) for x in t.rewards], image_cells(t.images)
                )
                for g, t in sorted(trajs.items())
            ]
        if events:  # the prompt cache's hits and misses of the iteration (evaluation's: the next one's)
            events[-1].update(embed.report())
        end = IterationEnd(
            step_stats, store.version, 0, 1, events, time.time() - t_start, timeline=events, grid=grid
        )
        metrics = finish_iteration(run, book, end)
        if checkpoints(cfg, k):
            save_checkpoint(run.checkpoint_dir(k), store, k, keep=cfg.output.keep_checkpoints)
        if progress is not None:
            progress(metrics)
        if held_out and evaluates(cfg, k):  # the weights of version k + 1 are loaded
            row = evaluate_inline(policy, cfg, reward, run, held_out, k, embed=embed)
            if progress is not None:
                progress(progress_row(row))
    return run.write_summary("reference")


def mini_batch_tasks(book: IterationBook, m: int) -> list[tuple[int, int | None]]:
    """The train tasks (group, part) of mini-batch ``m``, in order: its whole groups, or with
    ``train.mini_batch_split: samples`` every group's part ``m`` (the distributed modes'
    tasks, :class:`digen.core.scheduler.Scheduler`); with ``train.groups_per_task`` > 1 only
    each task's first group names it (:meth:`IterationBook.task_groups`)."""
    if book.by_samples:  # every group is scored here
        return [(g, m) for g in range(len(book.groups)) if book.task_groups(g).start == g]
    return [
        (g, None)
        for g in book.trainable_groups()
        if book.mini_batch(g) == m and book.task_groups(g).start == g
    ]
