"""Poison tasks: a task that fails schedule.max_attempts times goes to the dead letters with its
error; the job reports it and, by schedule.on_poison, drops its samples or fails."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from digen.runtime.controller import PoisonTask
from digen.testing.faults import Fault
from tests.reliability.conftest import max_diff, metrics, one_thread, run_job, weights

pytestmark = pytest.mark.slow

POISON = {"mode": "disaggregated", "gap": True, "max_staleness": 0, "max_attempts": 2}


@pytest.fixture(scope="module")
def reference_without_group(tiny_sd3: Path, tmp_path_factory) -> Path:
    """The reference run in which iteration 1's group 0 scored NaN (dropped samples)."""
    import digen.reference as trainer
    from tests.reliability.conftest import fault_config

    real = trainer.build_reward
    calls = {"n": 0}

    def nan_third_group(cfg):
        reward = real(cfg)

        def score(images, prompts):
            calls["n"] += 1
            r = reward(images, prompts)
            return torch.full_like(r, float("nan")) if calls["n"] == 3 else r  # iteration 1, group 0

        return score

    out = tmp_path_factory.mktemp("ref-nan") / "run"
    trainer.build_reward = nan_third_group
    try:
        with one_thread():
            trainer.run_reference(fault_config(tiny_sd3), out)
    finally:
        trainer.build_reward = real
    return out


def test_dead_tasks_are_dropped_with_on_poison_drop(
    tiny_sd3: Path, reference_without_group: Path, tmp_path: Path
):
    from tests.reliability.conftest import fault_config

    cfg = fault_config(
        tiny_sd3,
        schedule={**POISON, "on_poison": "drop"},
        cluster__local={"rollout_workers": 1, "trainer_workers": 1},
    )
    out = tmp_path / "run"
    fired = run_job(
        cfg,
        out,
        "poison-drop",
        Fault("gen", "raise", task="gen:1:0", times=2),  # a reward that raises, twice
        Fault("train", "raise", task="train:2:1", times=2),
    )
    assert [f["task"] for f in fired] == ["gen:1:0", "gen:1:0", "train:2:1", "train:2:1"]

    dead = [json.loads(line) for line in (out / "dead_letters.jsonl").read_text().splitlines()]
    assert [(d["task"], d["attempts"], d["action"]) for d in dead] == [
        ("gen:1:0", 2, "drop"),
        ("train:2:1", 2, "drop"),
    ]
    assert all(d["error"].startswith("InjectedFault: injected fault") for d in dead)

    rows = metrics(out)
    assert [m.get("dead_tasks") for m in rows] == [None, ["gen:1:0"], ["train:2:1"]]
    assert [(m["samples"], m["dropped_samples"]) for m in rows] == [(8, 0), (4, 4), (4, 4)]
    assert [m["trained_rows"] for m in rows] == [16, 8, 8]
    # a dead generation task is exactly a group whose rewards were all NaN
    want = metrics(reference_without_group)
    for g, w in zip(rows, want, strict=True):
        assert g["rewards"] == pytest.approx(w["rewards"], abs=1e-6, nan_ok=True)
    assert max_diff(weights(out, 1), weights(reference_without_group, 1)) <= 1e-5
    # a dead train task adds nothing: iteration 2's step differs from the reference's
    assert max_diff(weights(out, 2), weights(reference_without_group, 2)) > 1e-6


def test_a_poison_task_in_a_batch_dies_alone(tiny_sd3: Path, reference_without_group: Path, tmp_path: Path):
    from tests.reliability.conftest import fault_config

    cfg = fault_config(
        tiny_sd3,
        schedule={**POISON, "on_poison": "drop"},
        cluster__local={"rollout_workers": 1, "trainer_workers": 1},
        rollout__max_batch=2,  # gen:1:0 runs in a batch with gen:1:1
    )
    out = tmp_path / "run"
    # in the batch (which then runs each task alone), alone, and at its second attempt
    fired = run_job(cfg, out, "poison-batch", Fault("gen", "raise", task="gen:1:0", times=3))
    assert [f["task"] for f in fired] == ["gen:1:0"] * 3
    dead = [json.loads(line) for line in (out / "dead_letters.jsonl").read_text().splitlines()]
    assert [(d["task"], d["attempts"]) for d in dead] == [("gen:1:0", 2)]  # its batch-mate lives
    rows = metrics(out)
    assert [m.get("dead_tasks") for m in rows] == [None, ["gen:1:0"], None]
    assert [(m["samples"], m["dropped_samples"]) for m in rows] == [(8, 0), (4, 4), (8, 0)]
    want = metrics(reference_without_group)  # batched generation: within float32 round-off
    for g, w in zip(rows, want, strict=True):
        assert g["rewards"] == pytest.approx(w["rewards"], abs=1e-6, nan_ok=True)


def test_a_dead_task_fails_the_job_with_on_poison_fail(tiny_sd3: Path, tmp_path: Path):
    from tests.reliability.conftest import fault_config

    cfg = fault_config(
        tiny_sd3,
        schedule={**POISON, "on_poison": "fail"},
        cluster__local={"rollout_workers": 1, "trainer_workers": 1},
    )
    out = tmp_path / "run"
    with pytest.raises(PoisonTask) as err:
        run_job(cfg, out, "poison-fail", Fault("gen", "raise", task="gen:0:1", times=100))
    msg = str(err.value)
    assert "\n" not in msg and err.value.exit_code == 1
    assert msg.startswith("task gen:0:1 failed 2 time(s): InjectedFault: injected fault")
    assert "schedule.on_poison=drop" in msg and "--resume" in msg
    dead = [json.loads(line) for line in (out / "dead_letters.jsonl").read_text().splitlines()]
    assert [(d["task"], d["action"]) for d in dead] == [("gen:0:1", "fail")]
    assert "Traceback" in dead[0]["error"] or "line" in dead[0]["error"]  # the full error is kept
