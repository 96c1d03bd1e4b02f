"""Several optimizer steps per rollout batch in the reference loop (``train.mini_batches``)."""

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

TWO = {"train__mini_batches": 2, "rollout__batch_size": 16}  # 4 groups of 4: 2 groups per step


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def two_iterations(tiny_sd3: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference's run of 2 iterations of :data:`TWO`, once for the module: tests read it;
    the resume test resumes a copy of it."""
    out = tmp_path_factory.mktemp("mini-batches") / "run"
    run_reference(build_config(small_config_data(tiny_sd3, iterations=2, **TWO)), out)
    return out


def test_each_mini_batch_is_a_step_and_a_policy_version(two_iterations):
    run = two_iterations
    metrics = rows(run)
    assert [r["policy_version"] for r in metrics] == [2, 4]
    assert all(len(r["grad_norms"]) == 2 and r["grad_norm"] == sum(r["grad_norms"]) / 2 for r in metrics)
    assert [r["trained_rows"] for r in metrics] == [16 * 2, 16 * 2]  # every sample, floor(4 * 0.5) steps
    # the second mini-batch trains version 2k + 1 on trajectories of version 2k: off-policy
    assert all(r["ratio_max_dev"] > 0 for r in metrics)
    timeline = [json.loads(line) for line in (run / "timeline.jsonl").read_text().splitlines()]
    assert [e["version"] for e in timeline if e["kind"] == "optim"] == [1, 2, 3, 4]  # after each step
    assert {e["version"] for e in timeline if e["kind"] == "gen" and e["iteration"] == 1} == {2}


def test_one_mini_batch_is_on_policy_and_two_differ(small_config, tmp_path):
    run_reference(small_config(iterations=1, rollout__batch_size=16), tmp_path / "one")
    run_reference(small_config(iterations=1, **TWO), tmp_path / "two")
    one, two = rows(tmp_path / "one")[0], rows(tmp_path / "two")[0]
    assert one["rewards"] == two["rewards"]  # the same samples (version 0)
    assert one["ratio_max_dev"] == 0.0 and two["ratio_max_dev"] > 0
    w1 = load_file(str(tmp_path / "one/checkpoints/iter_0000/weights.safetensors"))
    w2 = load_file(str(tmp_path / "two/checkpoints/iter_0000/weights.safetensors"))
    assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) > 1e-5


def test_resume_with_mini_batches_equals_no_resume(two_iterations, small_config, tmp_path):
    run_reference(small_config(iterations=3, **TWO), tmp_path / "straight")
    shutil.copytree(two_iterations, tmp_path / "resumed")
    run_reference(small_config(iterations=3, **TWO), tmp_path / "resumed", resume=True)
    keep = ("rewards", "loss", "grad_norms", "policy_version", "ratio_max_dev")
    assert [{k: r[k] for k in keep} for r in rows(tmp_path / "straight")] == [
        {k: r[k] for k in keep} for r in rows(tmp_path / "resumed")
    ]
    a = load_file(str(tmp_path / "straight/checkpoints/iter_0002/weights.safetensors"))
    b = load_file(str(tmp_path / "resumed/checkpoints/iter_0002/weights.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
