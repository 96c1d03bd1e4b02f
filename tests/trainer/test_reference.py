"""The reference trainer: determinism, on-policy ratio, resume, run directory.

A run that several tests read is made once per module (``run_of``); a test that changes a run
(resumes it, appends to it, corrupts it) works on a copy of it, and a test about determinism
makes its second run itself."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from digen.config import build_config
from digen.reference import run_reference
from tests.conftest import small_config_data

LEARNING = (
    "iteration",
    "samples",
    "reward_mean",
    "reward_std",
    "loss",
    "approx_kl",
    "clipfrac",
    "grad_norm",
    "rewards",
    "policy_version",
)


def learning_rows(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: r[k] for k in LEARNING} for r in rows]


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    last = sorted((run / "checkpoints").glob("iter_*"))[-1]
    return load_file(str(last / "weights.safetensors"))


@pytest.fixture(scope="module")
def run_of(tiny_sd3: Path, tmp_path_factory: pytest.TempPathFactory):
    """``run_of(**sections)`` -> ``(run directory, summary)`` of the reference on
    ``small_config(**sections)``, run at the module's first call with those sections. Tests only
    read it: one that changes a run first copies it (:func:`copy_of`)."""
    runs: dict[tuple, tuple[Path, dict]] = {}

    def get(**sections) -> tuple[Path, dict]:
        key = tuple(sorted(sections.items()))
        if key not in runs:
            out = tmp_path_factory.mktemp("reference") / "run"
            summary = run_reference(build_config(small_config_data(tiny_sd3, **sections)), out)
            runs[key] = (out, summary)
        return runs[key]

    return get


def copy_of(run: Path, to: Path) -> Path:
    shutil.copytree(run, to)
    return to


def test_run_directory_and_on_policy_ratio(run_of):
    run, summary = run_of(iterations=2)
    for name in (
        "config.yaml",
        "metrics.jsonl",
        "timeline.jsonl",
        "summary.json",
        "samples/iter_0000.png",
        "checkpoints/iter_0001/weights.safetensors",
        "checkpoints/iter_0001/optimizer.safetensors",
    ):
        assert (run / name).exists(), name
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1]
    # one optimizer step per batch, no staleness: the first-pass ratio is exactly 1
    assert all(r["ratio_max_dev"] == 0.0 for r in rows)
    assert all(r["approx_kl"] == 0.0 and r["clipfrac"] == 0.0 for r in rows)
    assert rows[0]["trained_rows"] == 8 * 2  # 8 samples x floor(4 * 0.5) steps
    for key in (
        "iterations",
        "samples",
        "wall_s",
        "samples_per_s",
        "bubble_ratio",
        "reward_first",
        "reward_last",
        "max_staleness",
        "mode",
    ):
        assert key in summary
    assert summary["samples"] == 16
    # the weights moved
    w = final_weights(run)
    assert any(v.abs().sum() > 0 for k, v in w.items() if "lora_B" in k)


def test_same_seed_gives_the_same_metrics(run_of, small_config, tmp_path):
    a, _ = run_of(iterations=2)
    run_reference(small_config(), tmp_path / "b")  # a second run of the same config, from scratch
    assert learning_rows(a) == learning_rows(tmp_path / "b")
    wa, wb = final_weights(a), final_weights(tmp_path / "b")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_another_seed_gives_other_samples(run_of):
    (a, _), (b, _) = run_of(iterations=1), run_of(iterations=1, seed=4)
    assert learning_rows(a)[0]["rewards"] != learning_rows(b)[0]["rewards"]


def test_resume_equals_no_resume(run_of, small_config, tmp_path):
    straight, _ = run_of(iterations=4)
    resumed = copy_of(run_of(iterations=2)[0], tmp_path / "resumed")
    run_reference(small_config(iterations=4), resumed, resume=True)
    assert learning_rows(straight) == learning_rows(resumed)
    ws, wr = final_weights(straight), final_weights(resumed)
    assert all(torch.equal(ws[k], wr[k]) for k in ws)


def test_resume_drops_metrics_of_iterations_after_the_checkpoint(run_of, small_config, tmp_path):
    run = copy_of(run_of(iterations=2)[0], tmp_path / "run")
    # a crash after iteration 2's metrics but before its checkpoint leaves an extra row
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"iteration": 2, "samples": 8}) + "\n")
    run_reference(small_config(iterations=3), run, resume=True)
    its = [json.loads(line)["iteration"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert its == [0, 1, 2]


def test_existing_run_needs_resume(run_of, small_config, tmp_path):
    from digen.errors import ConfigError

    run = copy_of(run_of(iterations=1)[0], tmp_path / "run")
    with pytest.raises(ConfigError, match="--resume"):
        run_reference(small_config(iterations=1), run)


def test_corrupt_checkpoint_is_a_clear_error(run_of, small_config, tmp_path):
    from digen.errors import CheckpointError

    run = copy_of(run_of(iterations=1)[0], tmp_path / "run")
    (run / "checkpoints/iter_0000/weights.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="cannot be read"):
        run_reference(small_config(iterations=2), run, resume=True)


def test_nan_rewards_drop_samples_not_the_update(small_config, tmp_path, monkeypatch):
    import digen.reference as trainer

    real = trainer.build_reward

    def poisoned(cfg):
        reward = real(cfg)

        def score(images, prompts):
            r = reward(images, prompts)
            r[0] = float("nan")
            return r

        return score

    monkeypatch.setattr(trainer, "build_reward", poisoned)
    run_reference(small_config(iterations=1), tmp_path / "run")
    row = json.loads((tmp_path / "run/metrics.jsonl").read_text().splitlines()[0])
    assert row["dropped_samples"] == 2  # one per group
    assert row["samples"] == 6
    assert row["trained_rows"] == 6 * 2
    w = final_weights(tmp_path / "run")
    assert all(torch.isfinite(v).all() for v in w.values())
