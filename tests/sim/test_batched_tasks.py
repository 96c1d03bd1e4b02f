"""The simulator's batched train tasks (``groups_per_task``, as ``train.groups_per_task``):
a task's rows make the passes the runtime makes (``train.rows_per_forward`` rows at most with
TSP, one per trained step without), each computing at its own tokens' efficiency and
gathering the FSDP-sharded weights once."""

from __future__ import annotations

from dataclasses import replace

import pytest

from digen.core.events import Role
from digen.sim.costmodel import GpuType, ModelSpec, Workload, paper_costmodel
from digen.sim.costmodel import Testbed as Bed
from digen.sim.driver import MODES, simulate
from tests.sim.conftest import uniform_model

GPU = GpuType("g", tflops=300, memory_gb=80, host_gbps=50, intra_gbps=50)
FULL = ModelSpec(  # a full fine-tune: trained with FSDP, whose gathers dominate a small pass
    "full",
    tflop_per_step=2,
    cfg=1,
    weights_gb=24,
    adapter_gb=None,
    layers=40,
    activation_gb=4,
    train_flops_factor=3,
    decode_s_ref=0.1,
    reward_tflop=0.1,
    latent_numel=16 * 64 * 64,
)


def cost(per_task: int, model: ModelSpec = FULL):
    wl = Workload("w", model, steps=10, timestep_fraction=0.4, prompts=8, group_size=4, samples_per_task=1)
    return paper_costmodel(replace(wl, groups_per_task=per_task), Bed("t", 25, ((GPU, 4),)))


def train_seconds(res) -> float:
    return sum(r["end"] - r["start"] for r in res.rows if r["kind"] == "train")


@pytest.mark.parametrize("tsp", [True, False])
def test_a_batched_task_gathers_once_per_pass_for_all_its_micro_batches(tsp):
    c = cost(1).workers[0].cost
    assert c.train_gather_s > 0  # FSDP
    one = c.train_task_s(1, tsp)
    assert one == (c.train_tsp_s if tsp else c.train_s)
    per_micro_batch = [c.train_task_s(n, tsp) / n for n in (1, 2, 4, 8)]
    assert per_micro_batch == sorted(per_micro_batch, reverse=True) and per_micro_batch[-1] < 0.7 * one
    # what batching saves is gathers: never below the compute alone (a flat efficiency curve)
    compute = sum(c.passes.compute_s(r, tsp) for r in c.passes.sizes(1, tsp))
    assert per_micro_batch[-1] >= compute


def test_without_fsdp_batching_changes_nothing():
    lora = replace(FULL, adapter_gb=0.2)
    c = cost(1, lora).workers[0].cost
    assert c.train_gather_s == 0
    assert c.train_task_s(4, True) == pytest.approx(4 * c.train_tsp_s, rel=1e-12)  # flat curve


def test_a_larger_groups_per_task_reduces_the_simulated_fsdp_training_time():
    roles = {f"g-{i:04d}": Role.ROLLOUT if i < 2 else Role.TRAINER for i in range(4)}
    mode = MODES["disagg+gap+tsp"]
    times = [train_seconds(simulate(cost(n), mode, roles, iterations=3)) for n in (1, 2, 4)]
    assert times[0] > times[1] > times[2]
    # the same samples train: the work left is compute, the gathers are what went
    assert times[2] < 0.8 * times[0]


def test_a_batched_task_waits_for_every_micro_batch_of_the_prompt_groups_it_touches():
    # 2 micro-batches a prompt group, 3 a task: a task spans prompt groups; all train, once each
    c = uniform_model(workers=2, tasks=12, per_group=2)
    c.groups_per_task = 3
    res = simulate(c, MODES["disagg+gap"], {"w0": Role.ROLLOUT, "w1": Role.TRAINER}, iterations=3)
    trains = [r for r in res.rows if r["kind"] == "train"]
    assert len(trains) == 3 * 4  # 4 tasks of 3 micro-batches an iteration
    assert sum(r["end"] - r["start"] for r in trains) == pytest.approx(3 * 12 * 2.0)  # no FSDP: n x one


def test_the_bound_trains_in_the_batched_tasks_the_runtime_makes():
    """With ``groups_per_task`` > 1 a trainer's rate is of the batched task (fewer gathers per
    group), so no mode beats the bound; with 1 it is one micro-batch's."""
    from digen.sim.bounds import costmodel_bound
    from digen.sim.study import SimSettings, run_study

    one, four = cost(1), cost(4)
    w1, w4 = one.workers[0], four.workers[0]
    assert one.rates(w1)[1] == pytest.approx(1 / w1.cost.train_tsp_s)
    assert four.rates(w4)[1] == pytest.approx(4 / w4.cost.train_task_s(4, True))
    assert four.rates(w4)[1] > one.rates(w1)[1]
    study = run_study(four, ["digen"], SimSettings(iterations=5, warmup=2, trailing=1, neighbours=1))
    assert study.result("digen").fraction_of_bound <= 1.0
    assert costmodel_bound(four).x > costmodel_bound(one).x
