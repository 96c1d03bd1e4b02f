"""Metric loggers: namespacing, a TensorBoard file read back by tensorboard's own reader, W&B."""

from __future__ import annotations

import importlib.util

import pytest

from digen.config import build_config
from digen.errors import ConfigError
from digen.loggers import NullLogger, TensorBoardLogger, make_loggers, namespace, namespaced
from tests.conftest import required

from ._runs import metrics_rows


def _draw_grids(out):
    """A run directory's sample grids of iterations 0 and 2 and its eval grid of iteration 2,
    random pixels each: ``{(folder, iteration): pixels}``."""
    import numpy as np
    from PIL import Image

    (out / "samples").mkdir(parents=True)
    (out / "eval").mkdir()
    gen = np.random.default_rng(0)
    drawn = {}
    for where, k in (("samples", 0), ("samples", 2), ("eval", 2)):
        pixels = gen.integers(0, 256, (20, 30, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(out / where / f"iter_{k:04d}.png")
        drawn[(where, k)] = pixels
    return drawn


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


def test_tensorboard_shows_the_sample_and_eval_grids_as_images(tmp_path):
    """The grid a row drew goes to TensorBoard's IMAGES tab at its iteration, pixel for pixel
    (the run directory's PNG, decoded back from the event file)."""
    import io

    import numpy as np
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from digen.engine import grid_images

    out = tmp_path / "run"
    drawn = _draw_grids(out)
    logger = make_loggers(_cfg(tensorboard=True), out)
    rows = metrics_rows(3)
    for r in rows:  # iteration 1 drew no grid
        logger.log(r, r["iteration"], images=grid_images(out, r["iteration"]))
    logger.log({"eval/reward_mean": 0.5}, 2, images=grid_images(out, 2, evaluation=True))
    logger.close()
    assert grid_images(out, 1) == {}
    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"images": 0})
    acc.Reload()
    assert {"samples/grid", "eval/grid"} <= set(acc.Tags()["images"])
    samples = acc.Images("samples/grid")
    assert [e.step for e in samples] == [0, 2]
    for e, key in zip(samples, [("samples", 0), ("samples", 2)], strict=True):
        got = np.asarray(Image.open(io.BytesIO(e.encoded_image_string)).convert("RGB"))
        assert np.array_equal(got, drawn[key])
    (ev,) = acc.Images("eval/grid")
    got = np.asarray(Image.open(io.BytesIO(ev.encoded_image_string)).convert("RGB"))
    assert ev.step == 2 and np.array_equal(got, drawn[("eval", 2)])


def test_a_runs_sample_grids_reach_tensorboard(tiny_sd3, tmp_path):
    """``digen train`` with ``logging.tensorboard``: each iteration's grid, drawn into the run
    directory before the loggers hear of the row, is in TensorBoard's IMAGES at that iteration,
    pixel for pixel (the loggers alone showing images proves nothing of the run that feeds them)."""
    import io

    import numpy as np
    import yaml
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from typer.testing import CliRunner

    from digen.cli.main import app
    from tests.conftest import small_config_data

    path, out = tmp_path / "job.yaml", tmp_path / "run"
    path.write_text(yaml.safe_dump(small_config_data(tiny_sd3, logging={"tensorboard": True})))
    res = CliRunner().invoke(app, ["train", str(path), "--out", str(out), "--log-format", "quiet"])
    assert res.exit_code == 0, res.output
    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"images": 0})
    acc.Reload()
    grids = acc.Images("samples/grid")
    assert [e.step for e in grids] == [0, 1]
    for e in grids:
        got = np.asarray(Image.open(io.BytesIO(e.encoded_image_string)).convert("RGB"))
        drawn = np.asarray(Image.open(out / "samples" / f"iter_{e.step:04d}.png").convert("RGB"))
        assert np.array_equal(got, drawn)


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed")
def test_wandb_offline_run_holds_the_sample_and_eval_grids_as_images(tmp_path, monkeypatch):
    """The real wandb, offline (no network): each grid a row drew is in the run's media under
    its key, pixel for pixel and in the order logged, read back from the files the offline run
    writes (``files/media/images/<key>_<n>_<hash>.png``, wandb's naming: ``n`` counts its log
    calls, not the iteration, which is only in the run's binary history)."""
    import numpy as np
    from PIL import Image

    from digen.engine import grid_images

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    drawn = _draw_grids(out)
    logger = make_loggers(_cfg(wandb=True), out)
    for r in metrics_rows(3):  # iteration 1 drew no grid
        logger.log(r, r["iteration"], images=grid_images(out, r["iteration"]))
    logger.log({"eval/reward_mean": 0.5}, 2, images=grid_images(out, 2, evaluation=True))
    logger.close()
    (run,) = (out / "wandb").glob("offline-run-*")
    media = run / "files" / "media" / "images"
    for where, steps in (("samples", [0, 2]), ("eval", [2])):
        files = sorted(media.glob(f"{where}/grid_*.png"), key=lambda p: int(p.name.split("_")[1]))
        assert len(files) == len(steps), files  # one image per grid drawn, in the order logged
        for p, k in zip(files, steps, strict=True):
            got = np.asarray(Image.open(p).convert("RGB"))
            assert np.array_equal(got, drawn[(where, k)])
