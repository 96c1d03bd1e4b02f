"""Batched train tasks (``train.groups_per_task``) in the distributed runtime: real embedded
Redis, real Dask, real worker processes.

``digen`` mode (GAP, TAG, TSP; staleness 0) with two groups per task computes what the
reference loop computes with two groups per task: with the ``exact`` reduction bit for bit (the
same tasks, the same packing, the same order), with ``allreduce`` and RAT on within the
reference's own tolerance (tests/runtime/test_equivalence.py); a task's rows reach its trainer
in one forward when ``rows_per_forward`` allows, and RAT never splits a batched task."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from digen.reference import run_reference
from digen.runtime.controller import run_distributed
from tests.runtime.test_equivalence import DIGEN_WEIGHTS_ATOL, checkpoint, max_diff, metrics

pytestmark = pytest.mark.slow

BATCHED = {"rollout__batch_size": 16, "train__groups_per_task": 2, "schedule__tsp": True}
"""4 groups of 4 samples (8 rows each): 2 train tasks of 2 groups an iteration, one forward each."""


@pytest.fixture(scope="module")
def reference_batched(tiny_sd3, tmp_path_factory):
    from digen.config import build_config
    from tests.conftest import small_config_data

    out = tmp_path_factory.mktemp("ref_batched") / "run"
    run_reference(build_config(small_config_data(tiny_sd3, iterations=2, **BATCHED)), out)
    return out


def digen_run(small_config, scheduler: str, out: Path, reduce: str, rat: bool) -> tuple[Path, list[dict]]:
    cfg = small_config(
        iterations=2,
        schedule__mode="digen",
        schedule__max_staleness=0,
        schedule__rat=rat,
        cluster__local={"rollout_workers": 1, "trainer_workers": 2},
        train__reduce=reduce,
        **BATCHED,
    )
    run_distributed(cfg, out, scheduler=scheduler)
    timeline = [json.loads(line) for line in (out / "timeline.jsonl").read_text().splitlines()]
    return out, timeline


def test_digen_mode_with_batched_tasks_equals_the_batched_reference_bit_for_bit(
    reference_batched, small_config, warm_cluster, tmp_path
):
    out, timeline = digen_run(small_config, warm_cluster(1, 2), tmp_path / "exact", "exact", rat=False)
    trains = [e for e in timeline if e["kind"] == "train"]
    assert sorted(e["task"] for e in trains) == ["train:0:0", "train:0:2", "train:1:0", "train:1:2"]
    assert all(e["share"] == 2 for e in trains)  # two groups' work each (the bench counts it so)
    got, ref = metrics(out), metrics(reference_batched)
    assert [r["train_forwards"] for r in got] == [r["train_forwards"] for r in ref] == [2, 2]
    keep = ("rewards", "loss", "approx_kl", "clipfrac", "grad_norm", "trained_rows")
    assert [{k: r[k] for k in keep} for r in got] == [{k: r[k] for k in keep} for r in ref]
    for name in ("weights", "optimizer"):
        a, b = checkpoint(reference_batched, name), checkpoint(out, name)
        assert all(torch.equal(a[k], b[k]) for k in a), (name, max_diff(a, b))


def test_allreduce_with_rat_trains_whole_batched_tasks_within_the_tolerance(
    reference_batched, small_config, warm_cluster, tmp_path
):
    out, timeline = digen_run(small_config, warm_cluster(1, 2), tmp_path / "allreduce", "allreduce", rat=True)
    tasks = {e["task"] for e in timeline if e["kind"] == "train"}
    assert tasks == {"train:0:0", "train:0:2", "train:1:0", "train:1:2"}  # never a half (RAT)
    assert [r["trained_rows"] for r in metrics(out)] == [32, 32]
    assert max_diff(checkpoint(reference_batched), checkpoint(out)) <= DIGEN_WEIGHTS_ATOL


def test_a_batched_task_whose_trajectories_died_waits_for_all_its_groups_and_runs_whole(tiny_sd3, tmp_path):
    """The rollout worker dies right after the last group of iteration 1 is acknowledged (both
    groups' trajectories die with it) while the trainer is about to fetch them for the batched
    task ``train:1:0``: the task parks, both groups are generated again, and it runs once,
    whole; the job equals the batched reference bit for bit (``train.reduce: exact``)."""
    from digen.testing.faults import Fault
    from tests.conftest import faults_on
    from tests.reliability.conftest import fault_config, one_thread, run_job, timeline, weights

    ref = tmp_path / "ref"
    with one_thread():
        run_reference(fault_config(tiny_sd3, train__groups_per_task=2), ref)
    cfg = fault_config(
        tiny_sd3,
        train__groups_per_task=2,
        schedule={"mode": "disaggregated", "gap": True, "max_staleness": 0},
        cluster__local={"rollout_workers": 1, "trainer_workers": 1},
    )
    out = tmp_path / "run"
    with faults_on():  # the workers run the fault hooks
        fired = run_job(
            cfg,
            out,
            "batched-fetch",
            Fault("acked", "kill", worker="rollout-0", task="gen:1:1", flag="gone"),
            Fault("fetch", "hold", worker="trainer-0", task="train:1:0", flag="gone", seconds=120),
        )
    assert sorted((f["point"], f["task"]) for f in fired) == [("acked", "gen:1:1"), ("fetch", "train:1:0")]
    assert [m["trained_rows"] for m in metrics(out)] == [16, 16, 16]
    gens = sorted(e["task"] for e in timeline(out) if e["kind"] == "gen" and e["iteration"] == 1)
    assert gens == ["gen:1:0", "gen:1:0", "gen:1:1", "gen:1:1"]  # both groups of the task again
    assert [e["task"] for e in timeline(out) if e["kind"] == "train" and e["iteration"] == 1] == ["train:1:0"]
    assert metrics(out) and [m["rewards"] for m in metrics(out)] == [m["rewards"] for m in metrics(ref)]
    a, b = weights(out), weights(ref)
    assert all(torch.equal(a[k], b[k]) for k in a), max_diff(a, b)
