"""The reference trainer: determinism, on-policy ratio, resume, run directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from digen.reference import run_reference

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


def test_run_directory_and_on_policy_ratio(small_config, tmp_path):
    summary = run_reference(small_config(), tmp_path / "run")
    run = tmp_path / "run"
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


def test_same_seed_gives_the_same_metrics(small_config, tmp_path):
    run_reference(small_config(), tmp_path / "a")
    run_reference(small_config(), tmp_path / "b")
    assert learning_rows(tmp_path / "a") == learning_rows(tmp_path / "b")
    wa, wb = final_weights(tmp_path / "a"), final_weights(tmp_path / "b")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_another_seed_gives_other_samples(small_config, tmp_path):
    run_reference(small_config(iterations=1), tmp_path / "a")
    run_reference(small_config(iterations=1, seed=4), tmp_path / "b")
    assert learning_rows(tmp_path / "a")[0]["rewards"] != learning_rows(tmp_path / "b")[0]["rewards"]


def test_resume_equals_no_resume(small_config, tmp_path):
    run_reference(small_config(iterations=4), tmp_path / "straight")
    run_reference(small_config(iterations=2), tmp_path / "resumed")
    run_reference(small_config(iterations=4), tmp_path / "resumed", resume=True)
    assert learning_rows(tmp_path / "straight") == learning_rows(tmp_path / "resumed")
    ws, wr = final_weights(tmp_path / "straight"), final_weights(tmp_path / "resumed")
    assert all(torch.equal(ws[k], wr[k]) for k in ws)


def test_resume_drops_metrics_of_iterations_after_the_checkpoint(small_config, tmp_path):
    run = tmp_path / "run"
    run_reference(small_config(iterations=2), run)
    # a crash after iteration 2's metrics but before its checkpoint leaves an extra row
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"iteration": 2, "samples": 8}) + "\n")
    run_reference(small_config(iterations=3), run, resume=True)
    its = [json.loads(line)["iteration"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert its == [0, 1, 2]


def test_existing_run_needs_resume(small_config, tmp_path):
    from digen.errors import ConfigError

    run_reference(small_config(iterations=1), tmp_path / "run")
    with pytest.raises(ConfigError, match="--resume"):
        run_reference(small_config(iterations=1), tmp_path / "run")


def test_corrupt_checkpoint_is_a_clear_error(small_config, tmp_path):
    from digen.errors import CheckpointError

    run = tmp_path / "run"
    run_reference(small_config(iterations=1), run)
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
