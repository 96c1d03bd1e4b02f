"""Split search, the ablation ladder and the shipped paper-scale configs."""

from __future__ import annotations

from pathlib import Path

import pytest

from digen.sim.catalog import is_run_config, load_sim_config
from digen.sim.costmodel import GpuType, ModelSpec, Workload, paper_costmodel, sp_degree
from digen.sim.costmodel import Testbed as Bed
from digen.sim.driver import ALONE, LADDER
from digen.sim.study import SimSettings, run_study

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "sim"
H100 = GpuType("h100", tflops=309, memory_gb=80, host_gbps=50, intra_gbps=100)
SMALL = GpuType("small", tflops=100, memory_gb=26, host_gbps=25, intra_gbps=25)
MODEL = ModelSpec(
    "m",
    tflop_per_step=20,
    cfg=2,
    weights_gb=20,
    adapter_gb=0.2,
    layers=40,
    activation_gb=6,
    train_flops_factor=4,
    decode_s_ref=0.5,
    reward_tflop=0.5,
    latent_numel=1024 * 64,
    sp_efficiency={2: 1.03, 4: 0.9},
)


MID = GpuType("mid", tflops=150, memory_gb=80, host_gbps=25, intra_gbps=25)


def small_study(testbed: Bed, modes: list[str], prompts: int = 4):
    wl = Workload(
        "w", MODEL, steps=10, timestep_fraction=0.4, prompts=prompts, group_size=4, samples_per_task=1
    )
    return run_study(paper_costmodel(wl, testbed), modes, SimSettings(iterations=4, warmup=1, neighbours=1))


@pytest.mark.parametrize("gpus", [((H100, 8),), ((H100, 4), (MID, 8))])
def test_ablation_ladder_never_loses_throughput(gpus):
    study = small_study(Bed("t", 25, gpus), ["colocated", *LADDER, *ALONE], prompts=8)
    speed = {r.mode: r.sim.samples_per_s for r in study.results}
    rungs = [speed[m] for m in LADDER]
    assert all(b >= a * (1 - 1e-9) for a, b in zip(rungs, rungs[1:], strict=False)), rungs
    assert all(speed[m] >= speed["disaggregated"] * (1 - 1e-9) for m in ALONE)
    assert speed["digen"] > speed["disaggregated"]
    assert all(0 < r.fraction_of_bound <= 1 + 1e-9 for r in study.results)


def test_json_rows_have_the_contract_fields():
    study = small_study(Bed("t", 25, ((H100, 4),)), ["colocated", "digen"])
    rows = [r.to_json() for r in study.results]
    assert [r["mode"] for r in rows] == ["colocated", "digen"]
    for r in rows:
        assert {
            "mode",
            "s_per_iteration",
            "samples_per_s",
            "bubble_ratio",
            "speedup_vs_colocated",
            "fraction_of_bound",
        } <= set(r)
    assert rows[0]["speedup_vs_colocated"] == 1.0
    assert rows[1]["rollout_gpus"] + rows[1]["trainer_gpus"] == 4


def test_sequence_parallelism_when_a_sample_does_not_fit_one_gpu():
    assert sp_degree(MODEL, H100) == 1
    assert sp_degree(MODEL, SMALL) == 2  # 20 GB weights + 6/2 GB activations <= 0.9 x 26 GB < 20 + 6
    cost = paper_costmodel(Workload("w", MODEL, 10, 0.4, 2, 4, 1), Bed("t", 25, ((SMALL, 4),)))
    assert len(cost.workers) == 2 and cost.gpu_count == 4


def test_shipped_configs_load_with_every_workload_and_testbed():
    files = [p for p in sorted(CONFIGS.glob("*.yaml")) if is_run_config(p)]
    seen = {(load_sim_config(p).workload.name, load_sim_config(p).testbed.name) for p in files}
    # the published runs the peers are checked on (digen.sim.validation)
    published = {("verl-omni-qwen-image-ocr", "H800x4"), ("verl-omni-qwen-image-full", "H200x4")}
    published.add(("verl-omni-qwen-image-full", "H100x64"))
    assert published <= seen
    workloads = {w for w, _ in seen} - {w for w, _ in published}
    assert len(workloads) == 4
    for w in workloads:
        assert {(w, tb) for tb in ("A", "B", "C", "A+C")} <= seen
    assert any(tb == "mixed-1024" for _, tb in seen)
    big = load_sim_config(CONFIGS / "hunyuan-video_mixed1024.yaml")
    assert big.cost.gpu_count == 1024


@pytest.mark.slow
def test_one_iteration_of_the_1024_gpu_cluster_takes_well_under_a_minute():
    import time

    from digen.sim.driver import MODES, simulate
    from digen.sim.study import analytic_split, roles_for, worker_order

    cost = load_sim_config(CONFIGS / "hunyuan-video_mixed1024.yaml").cost
    order = worker_order(cost)
    roles = roles_for(order, analytic_split(cost, MODES["digen"], order))
    t0 = time.process_time()
    res = simulate(cost, MODES["digen"], roles, iterations=2, warmup=1, trailing=0)
    assert (time.process_time() - t0) / 2 < 60
    assert res.samples_per_s > 0 and len(res.step_ends) == 2


@pytest.mark.slow
def test_sim_imports_stay_light():
    import subprocess
    import sys

    code = (
        "import sys, digen.sim.study, digen.sim.calibrate, digen.sim.report, digen.sim.catalog; "
        "bad = [m for m in ('torch', 'dask', 'redis', 'matplotlib') if m in sys.modules]; print(bad); "
        "sys.exit(1 if bad else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_node_shared_nic_testbed_is_the_h100x64_cluster_at_an_eighth_of_the_network():
    """H100x64-node-nic is H100x64 with one 400 Gb/s NIC per 8-GPU node, shared evenly: the same
    GPUs, and every network term (an FSDP group's cross-node gather, a version's fetch) 8x slower."""
    cfg = CONFIGS / "verl-omni-full-h100x64.yaml"
    own, shared = load_sim_config(cfg), load_sim_config(cfg, testbed="H100x64-node-nic")
    assert shared.testbed.gpus == own.testbed.gpus
    assert own.testbed.net_gbps / shared.testbed.net_gbps == pytest.approx(8)
    trainers = {w.name for w in own.cost.workers[:16]}  # two nodes: the gathers cross the network

    def gather(setup):
        return {
            w.name: w.cost.train_gather_s for w in setup.cost.split_workers(trainers) if w.name in trainers
        }

    g_own, g_shared = gather(own), gather(shared)
    assert all(g_shared[n] == pytest.approx(8 * g_own[n]) for n in trainers)
    assert shared.cost.dataplane.distribute_s(48, 16) == pytest.approx(
        8 * own.cost.dataplane.distribute_s(48, 16)
    )
