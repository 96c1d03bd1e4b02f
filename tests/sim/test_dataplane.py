"""The simulator's data plane: its formulas, its calibration from ``digen bench --dataplane``,
where the driver charges each phase, and the ``digen simulate`` columns that report it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from digen.bench.dataplane import ROLLOUTS, TRAINERS, TRAJECTORY_BYTES, Round, write_dataplane_report
from digen.core.events import Role
from digen.errors import ConfigError
from digen.sim.catalog import load_sim_config
from digen.sim.dataplane import GB, DataPlane, DataPlaneModel
from digen.sim.driver import MODES, simulate
from digen.sim.report import TABLE_HEADERS, text_table
from digen.sim.study import SimSettings, run_study
from tests.sim.conftest import split, uniform_model

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "sim"
MODEL = DataPlaneModel(reduce_efficiency=0.5, distribute_efficiency=0.25, trajectory_efficiency=0.8)


def plane(net: float = 25.0, **kw) -> DataPlane:
    """A 0.1 G-parameter adapter: 0.4 GB float32 gradient, 0.2 GB bfloat16 version."""
    return DataPlane(
        params=1e8, trajectory_bytes=1e7, net_gbps=net, mem_gbps={"fast": 2000.0}, model=MODEL, **kw
    )


def test_reduce_is_a_ring_of_the_float32_gradient_at_the_measured_fraction_of_the_link():
    p = plane()
    assert p.grad_bytes == 4e8
    assert p.reduce_s(1) == 0.0  # nobody to reduce with
    assert p.reduce_s(2) == pytest.approx(1 * 4e8 / (0.5 * 25 * GB))  # 2 (N-1)/N = 1
    for n in (4, 16, 1024):
        assert p.reduce_s(n) / p.reduce_s(2) == pytest.approx(2 * (n - 1) / n)
    assert plane(net=50).reduce_s(8) == pytest.approx(p.reduce_s(8) / 2)


def test_distribution_shares_the_trainers_links_among_the_rollout_workers_in_bfloat16():
    p = plane()
    assert p.version_bytes == p.grad_bytes / 2  # the rollout's dtype: half the float32 sum
    one = p.version_bytes / (0.25 * 25 * GB)  # one rollout worker's link takes in V
    assert p.distribute_s(2, 2) == pytest.approx(one)
    assert p.distribute_s(1, 16) == pytest.approx(one)  # more holders than takers: its own link bounds it
    assert p.distribute_s(8, 2) == pytest.approx(4 * one)  # each trainer serves R V / T
    assert p.distribute_s(32, 8) == pytest.approx(p.distribute_s(8, 2))
    assert plane(net=50).distribute_s(8, 2) == pytest.approx(2 * one)
    # train.fsdp: every rollout worker takes the shards in the same order, one holder at a time
    assert plane(sharded=True).distribute_s(8, 2) == pytest.approx(8 * one)
    assert p.distribute_s(0, 4) == 0.0


def test_step_is_memory_bound_on_the_slowest_trainer_gpu_and_the_trajectory_on_the_link():
    p = plane()
    assert p.step_s(["fast"]) == pytest.approx(1e8 * 28 / (2000 * GB))
    # a GPU type the catalog gives no bandwidth for: the model's assumption, slower here
    assert p.step_s(["fast", "other"]) == pytest.approx(1e8 * 28 / (MODEL.gpu_mem_gbps * GB))
    assert plane(sharded=True).step_s(["fast"] * 4) == pytest.approx(p.step_s(["fast"]) / 4)
    assert p.trajectory_s() == pytest.approx(1e7 / (0.8 * 25 * GB))
    s = p.for_split(["fast"] * 3, 5)
    assert (s.reduce_s, s.distribute_s) == (pytest.approx(p.reduce_s(3)), pytest.approx(p.distribute_s(5, 3)))


def bench_json(tmp_path: Path) -> Path:
    """A ``bench-dataplane.json`` as ``digen bench --dataplane`` writes it (measured numbers
    made up: the calibration is arithmetic on them)."""
    mib = 2**20
    rounds = [
        Round("small", 8 * mib, "dataplane", 0.01, 0.02, 0.01, 0.02, 0, 0, [1.0, 1.0], 2e9),
        Round("big", 72 * mib, "dataplane", 0.12, 0.42, 0.12, 0.13, 0, 0, [1.0001, 1.0001], 1.8e9),
        Round("through-redis-4x250mib", 250 * mib, "through-redis", 11.0, 0.3, 3.4),
    ]
    js, _ = write_dataplane_report(rounds, tmp_path, "digen bench --dataplane", "abc1234", "2026-12-06")
    return js


def test_calibration_from_the_bench_gives_its_rounds_seconds_back(tmp_path):
    js = bench_json(tmp_path)
    model = DataPlaneModel.load(js)  # the largest data-plane round
    data = json.loads(js.read_text())
    big = data["rounds"][1]
    assert model.reduce_efficiency == pytest.approx(big["efficiency"]["reduce"])
    assert "abc1234" in model.source and "round big" in model.source
    # the bench's own cluster, priced by the model: its measured seconds again
    p = DataPlane(
        params=big["bytes"] / 4,
        trajectory_bytes=TRAJECTORY_BYTES,
        net_gbps=big["link_bytes_per_s"] / GB,
        mem_gbps={},
        model=model,
    )
    s = p.for_split(["cpu"] * TRAINERS, ROLLOUTS)
    assert s.reduce_s == pytest.approx(big["reduce_s"], rel=1e-3)  # the ring sent 1.0001x, not 1x
    assert s.distribute_s == pytest.approx(big["distribute_s"])
    assert s.trajectory_s == pytest.approx(big["trajectory_s"])
    assert DataPlaneModel.load(tmp_path, size="small").reduce_efficiency == pytest.approx(
        data["rounds"][0]["efficiency"]["reduce"]
    )


def test_calibration_refuses_a_bench_without_efficiencies(tmp_path):
    bad = tmp_path / "bench-dataplane.json"
    bad.write_text(json.dumps({"rounds": [{"name": "x", "bytes": 1, "path": "dataplane", "efficiency": {}}]}))
    with pytest.raises(ConfigError, match="no data-plane round with efficiencies"):
        DataPlaneModel.load(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        DataPlaneModel.load(tmp_path / "nope.json")


def test_rollout_workers_fetch_each_new_version_and_trainers_fetch_trajectories_made_elsewhere():
    cost = uniform_model(workers=4, tasks=8, optim=0.1, sync=0.3, trajectory=0.05)
    res = simulate(cost, MODES["disaggregated"], split(cost, 2), iterations=3, warmup=1)
    fetches = [r for r in res.rows if r.get("part") == "weights fetch"]
    assert fetches and {r["role"] for r in fetches} == {"rollout"}  # trainers hold what they made
    assert all(r["end"] - r["start"] == pytest.approx(0.3) for r in fetches)
    assert {r["role"] for r in res.rows if r.get("part") == "trajectory fetch"} == {"trainer"}
    # per iteration: 4 tasks per trainer each fetch its group, 1 version per rollout worker
    assert res.dataplane == pytest.approx(
        {"reduce_s": 0.1, "step_s": 0.0, "distribute_s": 0.3, "trajectory_s": 4 * 0.05}
    )
    # synchronous: 4 + 0.3 fetch on the rollouts, 8 + 4 x 0.05 on the trainers, the 0.1 step
    assert res.s_per_iteration == pytest.approx(4 + 0.3 + 8 + 0.2 + 0.1)


def test_a_colocated_system_reduces_but_distributes_nothing():
    cost = uniform_model(workers=4, tasks=8, optim=0.1, sync=0.3, trajectory=0.05)
    peers = simulate(cost, MODES["colocated"], iterations=3, warmup=1)
    assert peers.dataplane == pytest.approx(
        {"reduce_s": 0.1, "step_s": 0.0, "distribute_s": 0.0, "trajectory_s": 0.0}
    )
    own = simulate(cost, MODES["colocated-digen"], iterations=3, warmup=1)
    assert own.dataplane["distribute_s"] == 0.0
    # dynamic pulls: a worker may train a group another generated, and then fetches it
    trained_elsewhere = [r for r in own.rows if r.get("part") == "trajectory fetch"]
    assert all(r["role"] == "colocated" for r in trained_elsewhere)


def test_the_split_sets_the_paper_scale_data_plane():
    setup = load_sim_config(CONFIGS / "flux_A.yaml")  # FLUX LoRA r64 (0.36 GB bf16) on 32 x L20, 25 GB/s
    p = setup.cost.dataplane
    assert isinstance(p, DataPlane)
    assert p.params == pytest.approx(64 * 49152 * 57) and p.net_gbps == 25  # counted from the architecture
    assert p.trajectory_bytes == pytest.approx(4 * (41 * 1024 * 64 + 40))  # 40 steps + 1 latents, 1 sample
    order = [w.name for w in setup.cost.workers]
    roles = {n: Role.ROLLOUT if i < 24 else Role.TRAINER for i, n in enumerate(order)}
    res = simulate(setup.cost, MODES["disaggregated"], roles, iterations=3, warmup=1)
    assert res.dataplane["reduce_s"] == pytest.approx(p.reduce_s(8))
    assert res.dataplane["distribute_s"] == pytest.approx(p.distribute_s(24, 8))
    assert p.distribute_s(24, 8) == pytest.approx(3 * p.distribute_s(8, 8))


def test_simulate_reports_the_data_plane_in_its_table_json_and_markdown(tmp_path):
    study = run_study(uniform_model(tasks=16, trajectory=0.05), ["colocated", "digen"], SimSettings(4, 1, 1))
    text = text_table(study)
    assert all(h in TABLE_HEADERS for h in ("reduce s", "step s", "distribute s", "trajectory s"))
    assert "| reduce s | step s | distribute s | trajectory s |" in text
    assert study.results[1].to_json()["dataplane"]["distribute_s"] == pytest.approx(0.1)

    from tests.sim.test_report import _small_config

    cfg = _small_config(tmp_path)
    res = CliRunner().invoke(
        app, ["simulate", str(cfg), "--modes", "colocated,digen", "--json", "--no-gantt"]
    )
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout[res.stdout.index("[") :])
    assert set(rows[0]["dataplane"]) == {"reduce_s", "step_s", "distribute_s", "trajectory_s"}
    assert rows[0]["dataplane"]["reduce_s"] > 0 and rows[0]["dataplane"]["distribute_s"] == 0  # colocated
    assert rows[1]["dataplane"]["distribute_s"] > 0
    # recalibrated from a bench: the same simulation with that bench's efficiencies
    js = bench_json(tmp_path / "bench")
    res2 = CliRunner().invoke(
        app,
        ["simulate", str(cfg), "--modes", "colocated,digen", "--json", "--no-gantt", "--dataplane", str(js)],
    )
    assert res2.exit_code == 0, res2.output
    rows2 = json.loads(res2.stdout[res2.stdout.index("[") :])
    ratio = DataPlaneModel().reduce_efficiency / DataPlaneModel.load(js).reduce_efficiency
    assert rows2[0]["dataplane"]["reduce_s"] == pytest.approx(rows[0]["dataplane"]["reduce_s"] * ratio)
    out = tmp_path / "results.md"
    res3 = CliRunner().invoke(
        app, ["simulate", str(tmp_path), "--all", "--modes", "colocated,digen", "--out", str(out)]
    )
    assert res3.exit_code == 0, res3.output
    md = out.read_text()
    assert (
        "| workload | testbed | mode | s/iteration | reduce s | step s | distribute s | trajectory s |" in md
    )
    assert "| flow-grpo-flux | C | digen |" in md and DataPlaneModel().describe() in md
