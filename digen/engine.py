"""Entry point of a training job: picks the reference loop or the distributed controller."""

from __future__ import annotations

from pathlib import Path

from digen.config import Config
from digen.trainer import ProgressFn, run_reference


def run_training(
    cfg: Config,
    out: Path,
    *,
    resume: bool = False,
    redis_url: str | None = None,
    scheduler: str | None = None,
    progress: ProgressFn | None = None,
) -> dict:
    """Run ``cfg`` to completion in ``out``; returns the summary. ``reference`` mode runs in
    this process; the others start (or join) Redis and a Dask cluster."""
    if cfg.schedule.mode == "reference":
        return run_reference(cfg, out, resume=resume, progress=progress)
    from digen.runtime.controller import run_distributed

    return run_distributed(cfg, out, resume=resume, redis_url=redis_url, scheduler=scheduler, progress=progress)
