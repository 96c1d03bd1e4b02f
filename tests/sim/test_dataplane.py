"""The simulator's data plane: its formulas, its calibration from ``digen bench --dataplane``,
where the driver charges each phase, and the ``digen simulate`` columns that report it."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from digen.assembly import trained_dtype
from digen.bench.dataplane import ROLLOUTS, TRAINERS, TRAJECTORY_BYTES, Round, write_dataplane_report
from digen.cli.main import app
from digen.config import build_config
from digen.core.events import Role
from digen.errors import ConfigError
from digen.sim import costmodel
from digen.sim.catalog import load_sim_config
from digen.sim.costmodel import GpuType, ModelSpec, Workload, paper_costmodel
from digen.sim.dataplane import GB, DataPlane, DataPlaneModel
from digen.sim.driver import MODES, simulate
from digen.sim.report import TABLE_HEADERS, text_table
from digen.sim.study import SimSettings, run_study
from tests.sim.conftest import split, uniform_model

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "sim"
MODEL = DataPlaneModel(reduce_efficiency=0.5, distribute_efficiency=0.25, trajectory_efficiency=0.8)


def plane(net: float = 25.0, **kw) -> DataPlane:
    """A 0.1 G-parameter model trained in full in bfloat16: 0.4 GB float32 gradient, 0.2 GB
    bfloat16 version."""
    kw.setdefault("version_bytes_per_param", 2)
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
    assert p.version_bytes == p.grad_bytes / 2  # a bfloat16 version: half the float32 sum
    assert plane(version_bytes_per_param=4).distribute_s(8, 2) == pytest.approx(2 * p.distribute_s(8, 2))
    one = p.version_bytes / (0.25 * 25 * GB)  # one rollout worker's link takes in V
    assert p.distribute_s(2, 2) == pytest.approx(one)
    assert p.distribute_s(1, 16) == pytest.approx(one)  # more holders than takers: its own link bounds it
    assert p.distribute_s(8, 2) == pytest.approx(4 * one)  # each trainer serves R V / T
    assert p.distribute_s(32, 8) == pytest.approx(p.distribute_s(8, 2))
    assert plane(net=50).distribute_s(8, 2) == pytest.approx(2 * one)
    assert p.distribute_s(0, 4) == 0.0


def test_an_fsdp_groups_shards_are_fetched_over_every_ranks_link():
    """train.fsdp: each rank serves its shard (V / T) and each rollout worker starts at its
    own rank, so the R fetches spread over the T ranks' links: the time falls as the ranks
    grow, down to one rollout worker's own link taking in V."""
    p = plane(sharded=True)
    one = p.version_bytes / (0.25 * 25 * GB)
    assert p.distribute_s(8, 2) == pytest.approx(4 * one)  # R V / T on each rank's link
    times = [p.distribute_s(32, t) for t in (1, 2, 4, 8, 16, 32, 64)]
    assert times == sorted(times, reverse=True) and times[0] == pytest.approx(32 * one)
    assert times[-2:] == [pytest.approx(one)] * 2  # no rollout worker takes in faster than its link
    assert p.distribute_s(32, 8) == pytest.approx(plane().distribute_s(32, 8))  # as whole holders


def test_an_fsdp_group_reduces_in_its_backward_passes_not_at_the_step():
    """FSDP2 reduce-scatters the gradient in every backward: the step has no all-reduce, and
    a pass's collectives are two bf16 all-gathers of the weights and the float32 gradient's
    reduce-scatter (4 P bytes)."""
    assert plane(sharded=True).reduce_s(16) == 0.0
    assert plane().reduce_s(16) > 0
    full = costmodel.ModelSpec("m", 1.0, 1, 40.0, None, 10, 1.0, 3.0, 0.0, 0.0, 64)
    lora = replace(full, adapter_gb=0.5)
    gpu = GpuType("g", 100.0, 80.0, 25.0, 400.0)
    # full fine-tune: 40 GB bf16 weights = 20 G parameters, an 80 GB float32 gradient
    assert costmodel.fsdp_pass_comm_s(full, gpu) == pytest.approx((2 * 40 + 80) / 400)
    # LoRA over a sharded base: the base gathered twice, only the adapter's gradient reduced
    assert costmodel.fsdp_pass_comm_s(lora, gpu) == pytest.approx((2 * 40 + 1.0) / 400)
    w = Workload("w", full, steps=10, timestep_fraction=0.2, prompts=2, group_size=2, samples_per_task=1)
    cost, fsdp = costmodel.worker_cost(w, gpu, 1)
    assert fsdp and cost.train_gather_s == pytest.approx(costmodel.fsdp_pass_comm_s(full, gpu))


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
        version_bytes_per_param=2,  # the bench serves its float32 tensors' bfloat16 copy
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


def _spec(dtype: str, lora_dtype: str, adapter: bool) -> ModelSpec:
    return ModelSpec(
        name="m", tflop_per_step=1.0, cfg=1, weights_gb=2.0, adapter_gb=0.2 if adapter else None, layers=4,
        activation_gb=1.0, train_flops_factor=3.0, decode_s_ref=0.0, reward_tflop=0.0, latent_numel=64,
        dtype=dtype, lora_dtype=lora_dtype,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("dtype", "lora_dtype", "adapter"),
    [
        ("bfloat16", "float32", True),  # digen's default adapter on a bf16 transformer
        ("bfloat16", "bfloat16", True),
        ("float32", "float32", True),
        ("bfloat16", "float32", False),  # a full fine-tune: the transformer's dtype
        ("float32", "bfloat16", False),
        ("float64", "bfloat16", True),  # a float64 model keeps float64 adapters
    ],
)
def test_a_simulated_version_moves_the_bytes_the_runtime_publishes(dtype, lora_dtype, adapter):
    """One case built both ways: the runtime's config and the trainer's publishing dtype
    (:func:`digen.assembly.trained_dtype`), and the simulator's model and its data plane."""
    cfg = build_config(
        {
            "model": {"path": "unused", "dtype": dtype, "lora": {"enabled": adapter, "dtype": lora_dtype}},
            "prompts": {"items": ["a red square"]},
            "reward": [{"name": "brightness"}],
        },
        check_paths=False,
        algorithms=False,
    )
    published = torch.empty(0, dtype=trained_dtype(cfg)).element_size()
    spec = _spec(dtype, lora_dtype, adapter)
    assert spec.version_bytes_per_param == published
    tb = costmodel.Testbed(
        "t", 25.0, ((GpuType("g", tflops=100.0, memory_gb=80.0, host_gbps=25.0, intra_gbps=100.0), 4),)
    )
    cost = paper_costmodel(Workload("w", spec, 10, 0.5, 4, 4, 1), tb)
    assert isinstance(cost.dataplane, DataPlane)
    trained_gb = 0.2 if adapter else 2.0  # the catalog's bf16 sizes: 2 B per parameter
    assert cost.dataplane.params == pytest.approx(trained_gb * GB / 2)
    assert cost.dataplane.version_bytes == pytest.approx(cost.dataplane.params * published)
    assert cost.workers[0].cost.load_s == pytest.approx(cost.dataplane.version_bytes / (25.0 * GB))


def test_the_catalogs_adapters_travel_in_float32():
    """``model.lora.dtype``'s default: a Qwen-Image LoRA r64 version is twice its bf16 size."""
    cost = load_sim_config(CONFIGS / "qwen-image_A.yaml").cost
    assert isinstance(cost.dataplane, DataPlane)
    assert cost.dataplane.version_bytes_per_param == 4
    assert cost.dataplane.version_bytes == pytest.approx(2 * cost.dataplane.params * 2)
