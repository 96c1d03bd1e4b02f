"""Sequence-parallel efficiency calibrated from a run directory's replica rows, from a
calibration file, and by the tiny-Wan micro-benchmark; the report names the degree chosen."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from digen.cli.main import app
from digen.errors import ConfigError
from digen.sim.calibrate import costmodel_from_run
from digen.sim.catalog import load_sim_config
from digen.sim.costmodel import GpuType, ModelSpec, sp_choice
from digen.sim.sp_calibration import (
    calibrated_model,
    load_calibration,
    save_calibration,
    sp_from_run,
)

SIM = Path(__file__).resolve().parents[2] / "configs" / "sim"
GROUP = 4


def _row(worker: str, kind: str, it: int, start: float, seconds: float, **extra) -> dict:
    role = "trainer" if kind == "train" else "rollout"
    return {
        "worker": worker,
        "gpu_type": "cpu",
        "role": role,
        "kind": kind,
        "iteration": it,
        "version": it,
        "start": start,
        "end": start + seconds,
        **extra,
    }


def write_run(root: Path, *, single: float | None = 2.0, replica: float | None = 1.25) -> Path:
    """A run directory in digen's on-disk layout (``config.yaml``, ``timeline.jsonl``,
    ``metrics.jsonl``): a d=1 rollout worker whose gen task takes ``single`` s, a 2-rank
    replica (leader ``sp-0``, follower ``sp-1``) whose gen task takes ``replica`` s, a trainer.
    Iteration 0 (warmup) is ten times slower."""
    sp = {"sp_degree": 2, "ranks": ["sp-0", "sp-1"]}
    rows = []
    for it in range(3):
        slow = 10.0 if it == 0 else 1.0
        t = 100.0 * it
        if single is not None:
            rows.append(_row("rollout-0", "gen", it, t, single * slow))
        if replica is not None:
            rows.append(_row("sp-0", "gen", it, t, replica * slow, **sp))
            rows.append(_row("sp-1", "gen", it, t, 7.0, **sp))  # a follower's own view: not the task's
        rows.append(_row("trainer-0", "train", it, t + 20, 3.0))
    root.mkdir()
    (root / "timeline.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "metrics.jsonl").write_text(
        "".join(json.dumps({"iteration": k, "samples": 8, "wall_s": 30.0}) + "\n" for k in range(3))
    )
    cfg = {"rollout": {"batch_size": 2 * GROUP, "group_size": GROUP}, "schedule": {"mode": "digen"}}
    (root / "config.yaml").write_text(yaml.safe_dump(cfg))
    return root


def test_efficiency_from_replica_rows_against_d1_workers_of_the_same_run(tmp_path):
    cal = sp_from_run(write_run(tmp_path / "run"))
    # 2.0 s vs 1.25 s per group of 4: speedup 1.6 on 2 ranks; the warmup and follower rows left out
    assert cal.efficiency == {2: pytest.approx(0.8)}
    assert cal.speedup[2] == pytest.approx(1.6)
    assert cal.gen_s_per_sample == {1: pytest.approx(0.5), 2: pytest.approx(1.25 / GROUP)}
    assert cal.tasks == {1: 2, 2: 2}


def test_efficiency_against_a_separate_d1_baseline_run(tmp_path):
    sp_only = write_run(tmp_path / "sp", single=None, replica=1.0)
    with pytest.raises(ConfigError, match="no d=1 gen rows of GPU type cpu"):
        sp_from_run(sp_only)
    base = write_run(tmp_path / "base", single=3.0, replica=None)
    assert sp_from_run(sp_only, baseline=base).efficiency == {2: pytest.approx(1.5)}
    with pytest.raises(ConfigError, match="no sequence-parallel gen rows"):
        sp_from_run(base)


def test_a_replica_is_one_simulated_worker_of_its_degree(tmp_path):
    cm = costmodel_from_run(write_run(tmp_path / "run"))
    gpus = {w.name: w.gpus for w in cm.workers}
    assert gpus == {"rollout-0": 1, "sp-0": 2, "trainer-0": 1}
    assert {w.name: w.cost.gen_s for w in cm.workers}["sp-0"] == pytest.approx(1.25)


def test_calibration_file_round_trip_and_validation(tmp_path):
    cal = sp_from_run(write_run(tmp_path / "run"))
    path = save_calibration(cal, tmp_path / "cal" / "sp.json")
    back = load_calibration(path)
    assert back.efficiency == cal.efficiency and back.gen_s_per_sample == cal.gen_s_per_sample
    assert load_calibration(tmp_path / "run").efficiency == cal.efficiency  # a run directory too
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**cal.to_json(), "sp_efficiency": {"2": -1}}))
    with pytest.raises(ConfigError, match=r"sp_efficiency\[2\] \(-1\) must be a positive finite"):
        load_calibration(bad)
    bad.write_text(json.dumps({"sp_efficiency": {"2": 0.5}}))
    with pytest.raises(ConfigError, match="format must be"):
        load_calibration(bad)


MODEL = ModelSpec(
    name="m",
    tflop_per_step=10.0,
    cfg=1,
    weights_gb=20.0,
    adapter_gb=0.1,
    layers=10,
    activation_gb=6.0,
    train_flops_factor=3.0,
    decode_s_ref=0.1,
    reward_tflop=0.0,
    latent_numel=1024 * 64,
    sp_efficiency={2: 1.03, 4: 0.9},
)
SMALL = GpuType("small", 100.0, 26.0, 25.0, 100.0)


def test_sp_choice_says_why_and_which_efficiency(tmp_path):
    cited = sp_choice(MODEL, SMALL, 4)
    assert (cited.degree, cited.replicas, cited.efficiency) == (2, 2, 1.03)
    text = cited.describe()
    assert "sequence parallel 2 (23.0 GB per sample fits 23.4 GB usable; at SP 1 26.0 GB does not)" in text
    assert "efficiency 1.030 (cited constant (catalog))" in text
    cal = sp_from_run(write_run(tmp_path / "run"))
    measured = sp_choice(calibrated_model(MODEL, cal, "run"), SMALL, 4)
    assert measured.efficiency == pytest.approx(0.8)
    assert "efficiency 0.800 (calibrated from run)" in measured.describe()
    with pytest.raises(ConfigError, match="3 x small is not a multiple of the sequence-parallel degree 2"):
        sp_choice(MODEL, SMALL, 3)


@pytest.mark.slow
def test_simulate_reports_the_degree_and_the_calibrated_efficiency(tmp_path):
    cal = sp_from_run(write_run(tmp_path / "run"))
    path = save_calibration(cal, tmp_path / "sp.json")
    config = SIM / "wan2.1_A.yaml"  # 14B Wan on 48 GB L20s: needs SP 2
    cited = load_sim_config(config)
    assert [(c.gpu_type, c.degree, c.efficiency) for c in cited.cost.sp] == [("l20", 2, 1.03)]
    measured = load_sim_config(config, calibration=path)
    assert measured.cost.sp[0].efficiency == pytest.approx(0.8)
    # less efficient replicas generate slower
    assert measured.cost.workers[0].cost.gen_s == pytest.approx(cited.cost.workers[0].cost.gen_s * 1.03 / 0.8)
    args = ["simulate", str(config), "--modes", "digen", "--no-gantt"]
    res = CliRunner().invoke(app, [*args, "--calibration", str(path)])
    assert res.exit_code == 0, res.output
    assert "l20: sequence parallel 2 (" in res.output and "efficiency 0.800 (calibrated from" in res.output
    res = CliRunner().invoke(app, [*args, "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.output[res.output.index("[") :])
    assert rows[0]["sequence_parallel"][0]["degree"] == 2
    assert rows[0]["sequence_parallel"][0]["efficiency_source"] == "cited constant (catalog)"


@pytest.mark.slow
def test_sp_bench_measures_and_writes_a_calibration(tmp_path):
    """The micro-benchmark on tiny sizes: a measured, positive, finite efficiency, written to a
    file ``digen simulate --calibration`` loads; the timed d=2 sample equals the d=1 one."""
    out = tmp_path / "sp.json"
    res = CliRunner().invoke(
        app,
        [
            "sp-bench",
            "--out",
            str(out),
            "--workdir",
            str(tmp_path / "w"),
            "--resolution",
            "32",
            "--frames",
            "5",
        ]
        + ["--steps", "2", "--repeats", "1", "--warmup", "0"],
    )
    assert res.exit_code == 0, res.output
    assert "efficiency" in res.output
    cal = load_calibration(out)
    eff = cal.efficiency[2]
    assert eff > 0 and math.isfinite(eff)
    assert cal.gen_s_per_sample[1] > 0 and cal.gen_s_per_sample[2] > 0
    assert eff == pytest.approx(cal.gen_s_per_sample[1] / (2 * cal.gen_s_per_sample[2]))
    assert cal.setup["max_abs_latent_diff"] <= 1e-5
    assert load_sim_config(SIM / "wan2.1_A.yaml", calibration=out).cost.sp[0].efficiency == pytest.approx(eff)
