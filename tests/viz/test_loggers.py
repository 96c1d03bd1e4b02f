"""Metric loggers: namespacing, a TensorBoard file read back by tensorboard's own reader, W&B."""

from __future__ import annotations

import importlib.util

import pytest

from digen.config import build_config
from digen.errors import ConfigError
from digen.loggers import NullLogger, TensorBoardLogger, make_loggers, namespace, namespaced
from tests.conftest import required

from ._runs import metrics_rows


def _cfg(**logging):
    return build_config(required({"logging": logging}), check_paths=False)


def test_namespaces():
    assert namespace("reward_mean") == "rollout/reward_mean"
    assert namespace("reward_std") == "rollout/reward_std"
    for k in ("loss", "approx_kl", "clipfrac", "kl", "grad_norm"):
        assert namespace(k) == f"train/{k}"
    for k in ("wall_s", "samples_per_s", "bubble_ratio"):
        assert namespace(k) == f"system/{k}"
    flat = namespaced(
        {"iteration": 3, "reward_mean": 0.5, "rewards": [0.1, 0.2], "mode": "digen", "ok": True, "loss": 1}
    )
    assert flat == {"rollout/reward_mean": 0.5, "train/loss": 1.0}


def test_tensorboard_event_file_holds_the_reward_series(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = make_loggers(_cfg(tensorboard=True), tmp_path)
    assert isinstance(logger, TensorBoardLogger)
    rows = metrics_rows(4)
    for r in rows:
        logger.log(r, step=r["iteration"])
    logger.close()
    files = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(files) == 1
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    scalars = acc.Tags()["scalars"]
    assert {"rollout/reward_mean", "train/approx_kl", "system/bubble_ratio"} <= set(scalars)
    series = acc.Scalars("rollout/reward_mean")
    assert [e.step for e in series] == [0, 1, 2, 3]
    assert [e.value for e in series] == pytest.approx([r["reward_mean"] for r in rows])
    assert "rollout/rewards" in acc.Tags()["histograms"]


def test_no_logger_configured_is_a_null_logger(tmp_path):
    assert isinstance(make_loggers(_cfg(), tmp_path), NullLogger)
    assert not (tmp_path / "tensorboard").exists()


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed")
def test_wandb_missing_says_how_to_install(tmp_path):
    with pytest.raises(ConfigError, match="pip install wandb"):
        make_loggers(_cfg(wandb=True, tensorboard=True), tmp_path)
    assert not (tmp_path / "tensorboard").exists()  # nothing opened before the error


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed")
def test_wandb_offline_writes_a_local_run(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    logger = make_loggers(_cfg(wandb=True), tmp_path)
    logger.log(metrics_rows(1)[0], step=0)
    logger.close()
    assert list((tmp_path / "wandb").glob("offline-run-*"))
