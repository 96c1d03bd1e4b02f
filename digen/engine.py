"""Entry point of a training job: picks the reference loop or the distributed controller.

Before anything starts (Redis, Dask, the run directory) every input is checked
(:func:`digen.checks.check_inputs`); then the run takes the run directory's lock
(:class:`~digen.rundir.RunLock`). Around the run it feeds each iteration's metrics to the
configured loggers (TensorBoard, W&B: :mod:`digen.loggers`) and, at the end, draws
``timeline.png`` and ``rewards.png`` (:mod:`digen.plots`) when ``output.plots`` is on. A full
disk anywhere ends the run with one line (:class:`~digen.rundir.DiskFull`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from digen.checks import check_inputs, checkpoint_estimate
from digen.cluster.placement import discover, plan_local
from digen.config import Config
from digen.errors import ConfigError
from digen.evaluation import eval_metrics
from digen.iteration import ProgressFn
from digen.loggers import MetricsLogger, check_loggers, make_loggers
from digen.rundir import RunLock, disk_writes


def run_training(
    cfg: Config,
    out: Path,
    *,
    resume: bool = False,
    redis_url: str | None = None,
    scheduler: str | None = None,
    progress: ProgressFn | None = None,
    cancelled: Callable[[], bool] | None = None,
    job_id: str | None = None,
    checked: bool = False,
) -> dict:
    """Run ``cfg`` to completion in ``out``; returns the summary. ``reference`` mode runs in
    this process; the others start (or join) Redis and a Dask cluster (``job_id``: the
    controller's key prefix in Redis; default a fresh one). A true ``cancelled()`` stops the
    run within one task (:class:`~digen.errors.JobCancelled`), keeping the last complete
    checkpoint. ``checked``: the caller already ran :func:`~digen.checks.check_inputs` (with
    ``health``: the reward servers were asked too, as this function asks them)."""
    check_loggers(cfg)
    if scheduler is None and (problem := device_problem(cfg)):
        raise ConfigError(problem)  # one line, before a worker fails on it
    if scheduler is None and cfg.schedule.mode != "reference":
        plan_local(cfg)  # workers that do not fit the GPUs: one line before anything starts
    if not checked:
        check_inputs(cfg, out, resume=resume, health=True, fresh=True)
    # a full disk anywhere in the run: one line, the bytes being those of a checkpoint
    with RunLock(out), disk_writes(out, needed=checkpoint_estimate(cfg, out, resume)):
        return _run(cfg, out, resume, redis_url, scheduler, progress, cancelled, job_id)


def grid_images(out: Path, iteration: int, *, evaluation: bool = False) -> dict[str, Path]:
    """The grid an iteration's row (or its evaluation) drew, for the loggers: written before
    the progress callback hears of it (:func:`~digen.iteration.finish_iteration`,
    :func:`~digen.evaluation.write_evaluation`); none when that iteration drew none."""
    tag, path = (
        ("eval/grid", out / "eval" / f"iter_{iteration:04d}.png")
        if evaluation
        else ("samples/grid", out / "samples" / f"iter_{iteration:04d}.png")
    )
    return {tag: path} if path.is_file() else {}


def device_problem(cfg: Config) -> str | None:
    """Why ``model.device`` cannot run on this machine (a CUDA device where ``nvidia-smi``, or
    ``$DIGEN_FAKE_GPUS``, shows no GPU, as in a recipe imported from a GPU cluster), or None.
    For a run whose workers are this machine's (no ``--scheduler``); imports no torch."""
    device = cfg.model.device
    if device.startswith("cuda") and not discover():
        return (
            f"model.device ({device}): this machine has no GPU (nvidia-smi lists none); "
            "--set model.device=auto runs on the GPU where there is one, else on the CPU"
        )
    return None


def _run(
    cfg: Config,
    out: Path,
    resume: bool,
    redis_url: str | None,
    scheduler: str | None,
    progress: ProgressFn | None,
    cancelled: Callable[[], bool] | None,
    job_id: str | None,
) -> dict:
    logger: MetricsLogger | None = None

    def observe(m: dict) -> None:
        nonlocal logger
        scalars = eval_metrics(m) if m.get("event") == "eval" else m if "event" not in m else None
        if scalars is not None and "iteration" in m:
            if logger is None:  # opened on the first iteration: the run directory is checked by then
                logger = make_loggers(cfg, out)
            k = int(m["iteration"])
            logger.log(scalars, k, images=grid_images(out, k, evaluation="event" in m))
        if progress is not None:
            progress(m)

    try:
        if cfg.schedule.mode == "reference":
            from digen.reference import run_reference  # torch: the distributed modes' controller imports none

            summary = run_reference(cfg, out, resume=resume, progress=observe, cancelled=cancelled)
        else:
            from digen.runtime.controller import run_distributed

            summary = run_distributed(
                cfg,
                out,
                resume=resume,
                redis_url=redis_url,
                scheduler=scheduler,
                progress=observe,
                cancelled=cancelled,
                job_id=job_id,
                rewards_checked=True,  # by check_inputs, here or by the caller
            )
    finally:
        if logger is not None:
            logger.close()
    if cfg.output.plots:
        from digen.plots import write_run_plots

        write_run_plots(out)
    return summary
