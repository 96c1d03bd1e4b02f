"""Optional metric loggers: TensorBoard event files and Weights & Biases (offline by default).

Turned on by the config's ``logging`` section::

    logging: {tensorboard: true, wandb: false, wandb_project: digen}

Files keep the flat keys of ``metrics.jsonl`` (docs/architecture.md); loggers get namespaced
ones: ``rollout/...`` (rewards, sample counts), ``train/...`` (loss, KL, clip fraction, gradient norm) and
``system/...`` (wall time, throughput, bubble ratio, staleness, workers). TensorBoard writes
into ``RUN_DIR/tensorboard``; W&B runs offline in ``RUN_DIR/wandb`` unless ``WANDB_MODE`` says
otherwise (``wandb sync`` uploads it later).

Images: the run's sample grid of an iteration (``samples/iter_NNNN.png``) as
``samples/grid`` and a held-out evaluation's grid (``eval/iter_NNNN.png``) as ``eval/grid``, at
the iteration's step: TensorBoard's IMAGES tab (``add_image``), W&B's media panel
(``wandb.Image``, captioned with the iteration), as Flow-GRPO logs its samples. The grid is the
file the run directory keeps (prompts and rewards drawn on it), sent once per grid drawn.

Use::

    logger = make_loggers(cfg, run_dir)
    logger.log(metrics_row, step=metrics_row["iteration"], images={"samples/grid": path})
    logger.close()
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Protocol

from digen.config import Config
from digen.errors import ConfigError

ROLLOUT_KEYS = (
    "samples",
    "dropped_samples",
    "zero_std_ratio",
    "embed_cache_hits",
    "embed_cache_misses",
    "embed_cache_hit_rate",
)
TRAIN_KEYS = ("loss", "approx_kl", "clipfrac", "kl", "grad_norm", "ratio_max_dev", "trained_rows", "lr")
SYSTEM_KEYS = (
    "wall_s",
    "samples_per_s",
    "bubble_ratio",
    "busy_s",
    "worker_s",
    "max_staleness",
    "policy_version",
    "workers",
)
SKIPPED = ("iteration",)
WANDB_MISSING = (
    "logging.wandb (true) needs the wandb package, which is not installed; "
    "install it with `pip install wandb` or set logging.wandb=false"
)


def namespace(key: str) -> str:
    """The logger name of a flat metric key: ``reward_mean`` -> ``rollout/reward_mean``."""
    if key.startswith("eval/"):  # held-out evaluation (digen.evaluation.eval_metrics)
        return key
    if key.startswith("reward") or key in ROLLOUT_KEYS:
        return f"rollout/{key}"
    if key in TRAIN_KEYS:
        return f"train/{key}"
    if key in SYSTEM_KEYS:
        return f"system/{key}"
    return f"other/{key}"


def namespaced(metrics: dict[str, Any]) -> dict[str, float]:
    """Scalar metrics under namespaced keys; lists, strings, None and ``iteration`` are left out
    (``rewards``, the per-sample list, goes to histograms instead)."""
    out = {}
    for k, v in metrics.items():
        if k in SKIPPED or isinstance(v, bool) or not isinstance(v, int | float):
            continue
        out[namespace(k)] = float(v)
    return out


def _per_sample_rewards(metrics: dict[str, Any]) -> list[float]:
    vals = metrics.get("rewards")
    if not isinstance(vals, list):
        return []
    return [float(x) for x in vals if isinstance(x, int | float) and math.isfinite(float(x))]


def _rgb(path: Path):
    """A PNG as a uint8 ``[H, W, 3]`` array."""
    import numpy as np
    from PIL import Image

    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"))


class MetricsLogger(Protocol):
    def log(self, metrics: dict[str, Any], step: int, images: dict[str, Path] | None = None) -> None: ...

    def close(self) -> None: ...


class NullLogger:
    """Logs nothing (no logger configured)."""

    def log(self, metrics: dict[str, Any], step: int, images: dict[str, Path] | None = None) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardLogger:
    """Scalars (namespaced), a per-sample reward histogram and the grids (images) into
    ``log_dir``'s event file."""

    def __init__(self, log_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # torch's writer needs the tensorboard package
            raise ConfigError(
                f"logging.tensorboard (true) needs the tensorboard package ({exc}); "
                f"install it with `pip install tensorboard` or set logging.tensorboard=false"
            ) from None
        self.log_dir = Path(log_dir)
        self._writer = SummaryWriter(log_dir=str(self.log_dir))

    def log(self, metrics: dict[str, Any], step: int, images: dict[str, Path] | None = None) -> None:
        for key, value in namespaced(metrics).items():
            self._writer.add_scalar(key, value, step)
        rewards = _per_sample_rewards(metrics)
        if rewards:
            import numpy as np

            self._writer.add_histogram("rollout/rewards", np.asarray(rewards), step)
        for tag, path in (images or {}).items():
            self._writer.add_image(tag, _rgb(path), step, dataformats="HWC")
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbLogger:
    """A W&B run; ``mode`` offline (the default) writes under ``dir`` with no network."""

    def __init__(self, project: str, run_dir: Path, config: dict[str, Any], mode: str | None = None):
        try:
            import wandb
        except ImportError:
            raise ConfigError(WANDB_MISSING) from None
        mode = mode or os.environ.get("WANDB_MODE", "offline")
        run_dir.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(project=project, dir=str(run_dir), mode=mode, config=config, name=run_dir.name)

    def log(self, metrics: dict[str, Any], step: int, images: dict[str, Path] | None = None) -> None:
        import wandb

        data: dict[str, Any] = dict(namespaced(metrics))
        for tag, path in (images or {}).items():
            data[tag] = wandb.Image(str(path), caption=f"{tag} after iteration {step}")
        self._run.log(data, step=step)

    def close(self) -> None:
        self._run.finish()


class MultiLogger:
    """Fans each call out to several loggers."""

    def __init__(self, loggers: list[MetricsLogger]):
        self.loggers = loggers

    def log(self, metrics: dict[str, Any], step: int, images: dict[str, Path] | None = None) -> None:
        for lg in self.loggers:
            lg.log(metrics, step, images)

    def close(self) -> None:
        for lg in self.loggers:
            lg.close()


def check_loggers(cfg: Config) -> None:
    """Raise :class:`ConfigError` now if a logger ``cfg.logging`` asks for cannot be made
    (its package is missing), before a run starts and without writing anything."""
    import importlib.util

    problems = []
    if cfg.logging.tensorboard and importlib.util.find_spec("tensorboard") is None:
        problems.append(
            "logging.tensorboard (true) needs the tensorboard package, which is not installed; "
            "install it with `pip install tensorboard` or set logging.tensorboard=false"
        )
    if cfg.logging.wandb and importlib.util.find_spec("wandb") is None:
        problems.append(WANDB_MISSING)
    if problems:
        raise ConfigError(problems)


def make_loggers(cfg: Config, run_dir: str | Path) -> MetricsLogger:
    """The loggers ``cfg.logging`` asks for, writing under ``run_dir``; a :class:`NullLogger`
    when none is on. Raises :class:`ConfigError` when a requested package is missing."""
    check_loggers(cfg)  # before any logger opens a file
    run_dir = Path(run_dir)
    loggers: list[MetricsLogger] = []
    if cfg.logging.tensorboard:
        loggers.append(TensorBoardLogger(run_dir / "tensorboard"))
    if cfg.logging.wandb:
        loggers.append(
            WandbLogger(
                cfg.logging.wandb_project, run_dir, cfg.model_dump(mode="json", exclude={"source_dir"})
            )
        )
    if not loggers:
        return NullLogger()
    return loggers[0] if len(loggers) == 1 else MultiLogger(loggers)
