"""Several optimizer steps per rollout batch (``train.mini_batches``) and an algorithm with state
beside the weights (DiffusionNFT's old adapter) run in the distributed modes: the synchronous
modes (``train.reduce: exact``, staleness 0) equal the reference bit for bit, metrics, weights,
optimizer state and the algorithm's state alike; ``digen`` mode (staleness 1, all-reduce)
runs them to the end, one version per mini-batch."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from digen.config import build_config
from digen.reference import run_reference
from digen.runtime.controller import run_distributed

pytestmark = pytest.mark.slow

NFT = {"algorithm": "diffusion-nft", "mini_batches": 2}
KEYS = ("reward_mean", "loss", "grad_norm", "grad_norms", "trained_rows", "policy_version")


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def config(tiny_sd3: Path, train: dict, **sections):
    from tests.conftest import small_config_data

    d = small_config_data(tiny_sd3, **{"iterations": 3, "rollout__num_steps": 5, **sections})
    d["train"].update(train)
    return build_config(d)


def test_mini_batches_and_algorithm_state_equal_the_reference_bit_for_bit(tiny_sd3, tmp_path, warm_cluster):
    ref = tmp_path / "ref"
    run_reference(config(tiny_sd3, NFT), ref)
    assert [r["policy_version"] for r in rows(ref)] == [2, 4, 6]  # two optimizer steps an iteration
    for mode, trainers in (("colocated", 1), ("disaggregated", 2)):
        cfg = config(
            tiny_sd3,
            {**NFT, "reduce": "exact"},
            schedule={"mode": mode, "max_staleness": 0},
            cluster={"local": {"rollout_workers": 1, "trainer_workers": trainers}},
        )
        run_distributed(cfg, tmp_path / mode, scheduler=warm_cluster(1, trainers))
        for a, b in zip(rows(ref), rows(tmp_path / mode), strict=True):
            assert b["rewards"] == a["rewards"], mode
            assert {k: b[k] for k in KEYS} == {k: a[k] for k in KEYS}, mode
            assert len(b["grad_norms"]) == 2
        for name in ("weights", "optimizer"):  # the optimizer file holds NFT's algo/old/* too
            w_ref = load_file(str(ref / f"checkpoints/iter_0002/{name}.safetensors"))
            w_got = load_file(str(tmp_path / mode / f"checkpoints/iter_0002/{name}.safetensors"))
            assert w_ref.keys() == w_got.keys(), mode
            assert all(torch.equal(w_ref[k], w_got[k]) for k in w_ref), (mode, name)
        assert any(k.startswith("algo/old/") for k in w_got)


@pytest.mark.parametrize(
    "train", [{"mini_batches": 2}, {"algorithm": "diffusion-nft"}], ids=["mini-batches", "nft"]
)
def test_digen_mode_runs_mini_batches_and_algorithm_state_to_the_end(train, tiny_sd3, tmp_path, warm_cluster):
    cfg = config(
        tiny_sd3,
        train,
        schedule={"mode": "digen"},
        cluster={"local": {"rollout_workers": 1, "trainer_workers": 2}},
    )
    run_distributed(cfg, tmp_path / "digen", scheduler=warm_cluster(1, 2))
    metrics = rows(tmp_path / "digen")
    steps = cfg.train.mini_batches
    assert [r["policy_version"] for r in metrics] == [steps * (k + 1) for k in range(3)]
    assert metrics[-1]["max_staleness"] == 1  # pipelined: one iteration behind
    for r in metrics:
        assert r["samples"] == 8 and all(math.isfinite(x) for x in r["rewards"])
        assert math.isfinite(r["loss"]) and r["grad_norm"] > 0
    state = json.loads((tmp_path / "digen/checkpoints/iter_0002/state.json").read_text())
    assert state["version"] == 3 * steps and state["previous_version"] == 2 * steps
