"""The simulator's batched generation (``max_batch``, as ``rollout.max_batch``): a rollout
worker leases up to that many generation tasks of one version, runs them as one forward per
denoising step at the published batch gain, and each is acknowledged on its own."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from digen.sim.catalog import load_sim_config
from digen.sim.driver import MODES, simulate
from digen.sim.study import SimSettings, roles_for, run_study, worker_order

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "sim"
FAST = SimSettings(iterations=4, warmup=1, trailing=1, neighbours=0)


def _cost(max_batch: int):
    cost = load_sim_config(CONFIGS / "verl-omni-published.yaml").cost
    return replace(cost, max_batch=max_batch)


def test_a_batch_is_one_denoising_loop_at_the_batch_gain_and_each_task_counts_once():
    cost = _cost(4)
    c = cost.workers[0].cost
    gain = cost.paper.batch_gain
    tokens = cost.paper.workload.model.tokens
    assert c.gen_batch_s(4, 1) == pytest.approx(4 * c.gen_s / gain(4, tokens))
    assert c.gen_batch_s(1, 1) == c.gen_s
    roles = roles_for(worker_order(cost), 2)
    res = simulate(cost, MODES["digen"], roles, iterations=3, warmup=1, trailing=1)
    gens = [r for r in res.rows if r["kind"] == "gen" and r["role"] == "rollout"]
    assert max(r["end"] - r["start"] for r in gens) == pytest.approx(c.gen_batch_s(4, 1))
    # every sample of every iteration generated once: decode rows add up to the batch's samples
    decoded = sum((r["end"] - r["start"]) / c.decode_s for r in res.rows if r["kind"] == "decode")
    assert decoded == pytest.approx(3 * cost.samples)


@pytest.mark.slow
def test_batching_generation_is_faster_and_stays_within_the_bound():
    one = run_study(_cost(1), ["digen"], FAST).result("digen")
    eight = run_study(_cost(8), ["digen"], FAST).result("digen")
    assert eight.sim.samples_per_s > one.sim.samples_per_s
    assert eight.bound_samples_per_s > one.bound_samples_per_s  # the bound generates in batches too
    assert eight.fraction_of_bound <= 1.0


def test_max_batch_one_is_the_unbatched_schedule():
    a = simulate(_cost(1), MODES["colocated-digen"], iterations=3, warmup=1, trailing=1)
    b = simulate(
        load_sim_config(CONFIGS / "verl-omni-published.yaml").cost,
        MODES["colocated-digen"],
        iterations=3,
        warmup=1,
        trailing=1,
    )
    assert a.rows == b.rows


def test_an_fsdp_trainer_group_past_one_node_gathers_over_the_network():
    """digen's trainers shard a full fine-tune as one FSDP group (train.fsdp): with more GPUs
    than a node holds, its all-gathers run at the network's rate, as the peers' do."""
    cost = load_sim_config(CONFIGS / "verl-omni-full-h100x64.yaml").cost
    names = [w.name for w in cost.workers]

    def trainer_cost(trainers: int):
        return cost.split_workers(set(names[:trainers]))[0].cost

    node, two_nodes = trainer_cost(8), trainer_cost(16)
    gpu = cost.paper.testbed.gpus[0][0]
    assert node == cost.workers[0].cost
    assert two_nodes.train_gather_s == pytest.approx(
        node.train_gather_s * gpu.intra_gbps / cost.paper.testbed.net_gbps
    )
    assert two_nodes.train_tsp_s > node.train_tsp_s
