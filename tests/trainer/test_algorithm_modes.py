"""MixGRPO, GRPO-Guard, Flow-DPPO, no-CFG training, DGPO, AWM and online DPO run in every
mode: a short ``digen`` mode run each, and the synchronous modes (``train.reduce: exact``)
equal to the reference bit for bit for MixGRPO (whose trajectories hold only its window's
steps) and the clean-sample family beyond DiffusionNFT (DGPO's and online DPO's forwards read a
whole group; DGPO and AWM keep EMA weights beside the trained ones). The jobs run one after
another on the module's two warm clusters (``warm_cluster``: 1 rollout + 1 trainer, 1 + 2),
so each bit-for-bit comparison also checks that a worker which ran other algorithms' jobs
before computes what a fresh one does. Mini-batches and
DiffusionNFT's state: tests/trainer/test_mini_batch_modes.py."""

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

ALGORITHMS = {
    "mix-grpo": {"algorithm": "mix-grpo", "mix_grpo": {"window": 2, "iters_per_window": 1, "shift": 1}},
    "mix-grpo-flash": {
        "algorithm": "mix-grpo",
        "mix_grpo": {"window": 2, "flash": True, "flash_compress": 0.6},
    },
    "grpo-guard": {"algorithm": "grpo-guard", "clip_range": 2e-6},
    "flow-dppo": {"algorithm": "flow-dppo"},
    "no-cfg": {"kl_beta": 0.04, "kl_target": "velocity"},  # guidance 1 (the default) + the velocity KL
    "dgpo": {"algorithm": "dgpo", "kl_beta": 0.02, "dgpo": {"timesteps": 2, "trunc_steps": 2}},
    "awm": {"algorithm": "awm", "kl_beta": 1e-3, "awm": {"timesteps": 2, "fraction": 1.0}},
    "online-dpo": {"algorithm": "online-dpo"},
}
ROWS = {
    "mix-grpo": 2,
    "mix-grpo-flash": 2,
    "grpo-guard": 2,
    "flow-dppo": 2,
    "no-cfg": 2,
    "dgpo": 2,
    "awm": 2,
    "online-dpo": 0.5,  # one pair (2 rows) per group of 4
}  # trained rows per sample


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def data(tiny_sd3: Path, train: dict, **sections) -> dict:
    from tests.conftest import small_config_data

    d = small_config_data(tiny_sd3, **{"iterations": 2, "rollout__num_steps": 5, **sections})
    d["train"].update(train)
    return d


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_algorithm_trains_in_digen_mode(name, tiny_sd3, tmp_path, warm_cluster):
    cfg = build_config(
        data(
            tiny_sd3,
            ALGORITHMS[name],
            schedule={"mode": "digen"},
            cluster={"local": {"rollout_workers": 1, "trainer_workers": 1}},
        )
    )
    run_distributed(cfg, tmp_path / "digen", scheduler=warm_cluster(1, 1))
    metrics = rows(tmp_path / "digen")
    assert len(metrics) == 2 and metrics[-1]["max_staleness"] == 1  # pipelined, one version behind
    for r in metrics:
        assert r["samples"] == 8 and all(math.isfinite(x) for x in r["rewards"])
        assert r["trained_rows"] == 8 * ROWS[name] and math.isfinite(r["loss"]) and r["grad_norm"] > 0
    first = load_file(str(tmp_path / "digen/checkpoints/iter_0000/weights.safetensors"))
    last = load_file(str(tmp_path / "digen/checkpoints/iter_0001/weights.safetensors"))
    assert max(float((first[k] - last[k]).abs().max()) for k in first) > 0


@pytest.mark.parametrize("name", ["mix-grpo", "dgpo", "awm", "online-dpo"])
def test_synchronous_modes_equal_the_reference_bit_for_bit(name, tiny_sd3, tmp_path, warm_cluster):
    ref = tmp_path / "ref"
    run_reference(build_config(data(tiny_sd3, ALGORITHMS[name], iterations=3)), ref)
    for mode, trainers in (("colocated", 1), ("disaggregated", 2)):
        cfg = build_config(
            data(
                tiny_sd3,
                {**ALGORITHMS[name], "reduce": "exact"},  # gradients summed in the reference's order
                iterations=3,
                schedule={"mode": mode, "max_staleness": 0},
                cluster={"local": {"rollout_workers": 1, "trainer_workers": trainers}},
            )
        )
        run_distributed(cfg, tmp_path / mode, scheduler=warm_cluster(1, trainers))
        for a, b in zip(rows(ref), rows(tmp_path / mode), strict=True):
            assert b["rewards"] == a["rewards"], mode
            keys = (
                "reward_mean",
                "loss",
                "approx_kl",
                "clipfrac",
                "ratio_max_dev",
                "grad_norm",
                "trained_rows",
            )
            assert {k: b[k] for k in keys} == {k: a[k] for k in keys}, mode
        for part in ("weights", "optimizer"):  # the optimizer file holds DGPO's and AWM's algo/old/* too
            w_ref = load_file(str(ref / f"checkpoints/iter_0002/{part}.safetensors"))
            w_got = load_file(str(tmp_path / mode / f"checkpoints/iter_0002/{part}.safetensors"))
            assert w_ref.keys() == w_got.keys() and all(torch.equal(w_ref[k], w_got[k]) for k in w_ref), mode
