"""The planner (digen simulate --optimize): the split, groups_per_task and max_batch that the
cost model says run fastest, beside the configured plan."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from digen.errors import ConfigError
from digen.sim.catalog import load_sim_config
from digen.sim.driver import MODES
from digen.sim.planner import _cost, batch_fits, optimize
from digen.sim.study import SimSettings, roles_for, worker_order

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "sim"
FAST = SimSettings(iterations=4, warmup=1, trailing=1, neighbours=0)


@pytest.mark.slow
def test_the_best_plan_is_no_slower_than_the_configured_one_and_reproduces_when_simulated(monkeypatch):
    from digen.sim import planner

    # a smaller groups_per_task axis keeps this test's time; the whole axis is searched in
    # test_the_planner_searches_groups_per_task_up_to_the_iterations_micro_batches
    monkeypatch.setattr(planner, "GROUPS_PER_TASK", (1, 2, 4, 8))
    setup = load_sim_config(CONFIGS / "verl-omni-published.yaml")
    search = optimize(setup, "digen", FAST)
    assert search.best.samples_per_s >= search.configured.samples_per_s
    assert search.best in search.tried and len(search.tried) > 4
    best = search.best
    cost = _cost(setup, best.max_batch, best.groups_per_task)
    roles = roles_for(worker_order(cost), best.rollout_gpus)
    again = FAST.simulate(cost, MODES["digen"], roles)
    assert again.s_per_iteration == pytest.approx(best.s_per_iteration)
    assert best.rollout_gpus + best.trainer_gpus == 4


def test_a_batch_that_does_not_fit_a_rollout_gpu_is_not_planned():
    setup = load_sim_config(CONFIGS / "verl-omni-published.yaml")
    cost = setup.cost
    assert batch_fits(cost, 1)
    big = replace(setup.workload.model, activation_gb=10.0)
    heavy = replace(setup, workload=replace(setup.workload, model=big))
    assert not batch_fits(_cost(heavy, 8, 1), 8)


def test_the_planner_plans_a_disaggregated_mode_only():
    setup = load_sim_config(CONFIGS / "verl-omni-published.yaml")
    with pytest.raises(ConfigError, match="disaggregated"):
        optimize(setup, "verl-omni", FAST)


def test_another_cluster_of_the_catalogs_gpus():
    setup = load_sim_config(CONFIGS / "qwen-image_B.yaml", gpus="8xh100")
    assert setup.cost.gpu_count == 8 and setup.testbed.net_gbps == 50
    with pytest.raises(ConfigError, match="COUNTxTYPE"):
        load_sim_config(CONFIGS / "qwen-image_B.yaml", gpus="8xa999")


@pytest.mark.slow
def test_the_planner_searches_groups_per_task_up_to_the_iterations_micro_batches(monkeypatch):
    """The full fine-tune's 512 one-sample micro-batches: groups_per_task up to 512 (one train
    task per iteration), none past the iteration's micro-batches. One max_batch (the plan's,
    docs/benchmarks.md) keeps the search to the groups_per_task axis this test is about."""
    from digen.sim import planner

    monkeypatch.setattr(planner, "MAX_BATCHES", (32,))
    setup = load_sim_config(CONFIGS / "verl-omni-full-h200.yaml")
    assert setup.cost.tasks == 512
    search = optimize(setup, "digen", FAST)
    tried = {p.groups_per_task for p in search.tried}
    assert max(tried) == 512 and {1, 8, 64, 256} <= tried
    assert search.best.samples_per_s >= search.configured.samples_per_s
