"""Faults of the data plane: a trainer dies in the middle of the gradient reduction, a rollout
worker dies while it takes in a weight version, a rollout worker dies after its group was
acknowledged but before the trainer fetched it. Each job finishes with every iteration's
samples counted once and the reference's weights (within the all-reduce's float32 round-off
where the trainers all-reduce; bit for bit with ``train.reduce: exact``).

Faults are injected inside the worker processes (digen.testing.faults)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from digen.testing.faults import Fault
from tests.reliability.conftest import (
    assert_equals_reference,
    assert_exactly_once,
    fault_config,
    max_diff,
    metrics,
    run_job,
    timeline,
    weights,
)

pytestmark = pytest.mark.slow


def test_a_trainer_killed_during_the_reduction_takes_only_its_sum_the_step_is_done_again(
    tiny_sd3: Path, reference: Path, tmp_path: Path
):
    cfg = fault_config(
        tiny_sd3,
        schedule={"mode": "disaggregated", "gap": True, "max_staleness": 0},
        cluster__local={"rollout_workers": 1, "trainer_workers": 2},
        train__reduce="allreduce",
    )
    out = tmp_path / "run"
    fired = run_job(cfg, out, "dp-reduce", Fault("reduce", "kill", worker="trainer-1", iteration=1))
    assert [(f["point"], f["worker"], f["task"]) for f in fired] == [("reduce", "trainer-1", "step:1")]
    rows = metrics(out)
    assert [m["samples"] for m in rows] == [8, 8, 8] and [m["trained_rows"] for m in rows] == [16, 16, 16]
    runs = Counter((e["iteration"], e["kind"]) for e in timeline(out) if e["kind"] in ("gen", "train"))
    # iteration 1's two groups were generated once and trained twice: the first gradients died
    # with the aborted step (trainer-0's sum is dropped too: the step is applied by all or none)
    assert runs == {
        (0, "gen"): 2,
        (0, "train"): 2,
        (1, "gen"): 2,
        (1, "train"): 4,
        (2, "gen"): 2,
        (2, "train"): 2,
    }
    assert_equals_reference(out, reference)  # the all-reduce sums in another order: within 1e-5


def test_a_trainer_that_hangs_in_the_reduction_times_its_peer_out_and_the_step_is_done_again(
    tiny_sd3: Path, reference: Path, tmp_path: Path
):
    """What a dead GPU or a hung NCCL peer looks like: trainer-1 stays in the group, silent,
    past the group's collective timeout (a gloo group's is ``schedule.lease_s``; an NCCL
    group's half of it, with the settings that make it raise: tests/parallel/test_group_settings.py).
    trainer-0's all-reduce raises once the timeout passes and its step aborts; the step is
    asked again while trainer-1 is still silent (those attempts abort too: ``max_attempts`` is
    raised so that they do not end the job), and once trainer-1 is back the two form a group
    again and the step commits: the job ends as the reference. It once never did: a member
    whose formation had failed named its next group's keys one ahead of the others
    (``fresh_group_names``), and a member waiting for the address of an epoch its leader had
    found aborted waited for ever (the rendezvous now gives up once the step is decided)."""
    cfg = fault_config(
        tiny_sd3,
        schedule={
            "mode": "disaggregated",
            "gap": True,
            "max_staleness": 0,
            "lease_s": 4.0,
            "max_attempts": 20,
        },
        cluster__local={"rollout_workers": 1, "trainer_workers": 2},
        train__reduce="allreduce",
    )
    out = tmp_path / "run"
    stall = Fault("reduce", "stall", worker="trainer-1", iteration=1, seconds=9.0)
    fired = run_job(cfg, out, "dp-hang", stall)
    assert [(f["point"], f["worker"], f["action"]) for f in fired] == [("reduce", "trainer-1", "stall")]
    rows = metrics(out)
    assert [m["samples"] for m in rows] == [8, 8, 8] and [m["trained_rows"] for m in rows] == [16, 16, 16]
    runs = Counter((e["iteration"], e["kind"]) for e in timeline(out) if e["kind"] == "train")
    # iteration 1's groups were trained again after the aborted step (at least once more)
    assert runs[(0, "train")] == 2 and runs[(1, "train")] >= 4 and runs[(2, "train")] == 2, runs
    assert_equals_reference(out, reference)  # the all-reduce sums in another order: within 1e-5


def test_a_rollout_killed_while_it_takes_in_a_weight_version_fetches_it_again(
    tiny_sd3: Path, reference: Path, tmp_path: Path
):
    cfg = fault_config(
        tiny_sd3,
        schedule={"mode": "disaggregated", "gap": True, "max_staleness": 0},
        cluster__local={"rollout_workers": 1, "trainer_workers": 1},
    )
    out = tmp_path / "run"
    fired = run_job(cfg, out, "dp-sync", Fault("sync", "kill", worker="rollout-0", iteration=1))
    assert [(f["point"], f["worker"], f["task"]) for f in fired] == [("sync", "rollout-0", "weights:1")]
    assert_exactly_once(out)
    assert_equals_reference(out, reference)
    assert max_diff(weights(out), weights(reference)) == 0.0  # train.reduce: exact


def test_a_rollout_killed_after_its_group_was_acknowledged_has_the_group_generated_again(
    tiny_sd3: Path, reference: Path, tmp_path: Path
):
    cfg = fault_config(
        tiny_sd3,
        schedule={"mode": "disaggregated", "gap": True, "max_staleness": 0},
        cluster__local={"rollout_workers": 1, "trainer_workers": 1},
    )
    out = tmp_path / "run"
    fired = run_job(
        cfg,
        out,
        "dp-fetch",
        # the rollout worker dies right after gen:1:0 is acknowledged (its blob dies with it) ...
        Fault("acked", "kill", worker="rollout-0", task="gen:1:0", flag="gone"),
        # ... and the trainer fetches that group only once it is dead
        Fault("fetch", "hold", worker="trainer-0", task="train:1:0", flag="gone", seconds=120),
    )
    got = sorted((f["point"], f["action"], f["worker"], f["task"]) for f in fired)
    assert got == [("acked", "kill", "rollout-0", "gen:1:0"), ("fetch", "hold", "trainer-0", "train:1:0")]
    rows = metrics(out)
    assert [m["iteration"] for m in rows] == [0, 1, 2]
    assert [m["samples"] for m in rows] == [8, 8, 8] and [m["trained_rows"] for m in rows] == [16, 16, 16]
    assert_equals_reference(out, reference)
    assert max_diff(weights(out), weights(reference)) == 0.0  # train.reduce: exact
    # the group was generated twice (the lost copy and the new one), trained once
    gens = [e for e in timeline(out) if e["kind"] == "gen" and e["iteration"] == 1]
    trains = [e for e in timeline(out) if e["kind"] == "train" and e["iteration"] == 1]
    assert sorted(e["task"] for e in gens) == ["gen:1:0", "gen:1:0", "gen:1:1"]
    assert sorted(e["task"] for e in trains) == ["train:1:0", "train:1:1"]


def test_a_writer_that_cannot_write_the_checkpoint_ends_the_job_naming_why(tiny_sd3: Path, tmp_path: Path):
    from digen.errors import DigenError

    cfg = fault_config(
        tiny_sd3,
        schedule={"mode": "disaggregated", "gap": True, "max_staleness": 0},
        cluster__local={"rollout_workers": 1, "trainer_workers": 1},
    )
    out = tmp_path / "run"
    with pytest.raises(DigenError) as err:
        run_job(cfg, out, "dp-ckpt", Fault("checkpoint", "raise", worker="trainer-0", iteration=1))
    msg = str(err.value)
    assert msg.startswith("the checkpoint of iteration 1 could not be written: InjectedFault: injected fault")
    assert err.value.exit_code == 1
    assert [m["iteration"] for m in metrics(out)] == [0]  # iteration 1 did not end
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["iter_0000"]
