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


def digen_run(small_config, out: Path, reduce: str, rat: bool) -> tuple[Path, list[dict]]:
    cfg = small_config(
        iterations=2,
        schedule__mode="digen",
        schedule__max_staleness=0,
        schedule__rat=rat,
        cluster__local={"rollout_workers": 1, "trainer_workers": 2},
        train__reduce=reduce,
        **BATCHED,
    )
    run_distributed(cfg, out)
    timeline = [json.loads(line) for line in (out / "timeline.jsonl").read_text().splitlines()]
    return out, timeline


def test_digen_mode_with_batched_tasks_equals_the_batched_reference_bit_for_bit(
    reference_batched, small_config, tmp_path
):
    out, timeline = digen_run(small_config, tmp_path / "exact", "exact", rat=False)
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
    reference_batched, small_config, tmp_path
):
    out, timeline = digen_run(small_config, tmp_path / "allreduce", "allreduce", rat=True)
    tasks = {e["task"] for e in timeline if e["kind"] == "train"}
    assert tasks == {"train:0:0", "train:0:2", "train:1:0", "train:1:2"}  # never a half (RAT)
    assert [r["trained_rows"] for r in metrics(out)] == [32, 32]
    assert max_diff(checkpoint(reference_batched), checkpoint(out)) <= DIGEN_WEIGHTS_ATOL
