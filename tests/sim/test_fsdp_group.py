"""An FSDP trainer group in the simulator (a full fine-tune, ``train.fsdp``): one sharded model
that runs every train task on all of its ranks together, each rank its share of the rows, and
only trains (TAG and RAT off), as digen/workers/fsdp_loop.py does; the bound treats it alike."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from digen.core.events import Role
from digen.sim.bounds import costmodel_bound, lp_bound
from digen.sim.catalog import load_sim_config
from digen.sim.costmodel import _pass_s
from digen.sim.driver import MODES, simulate
from digen.sim.study import roles_for, worker_order

from .conftest import split, uniform_model

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "sim"


def _train_rows(res):
    return [r for r in res.rows if r["kind"] == "train"]


def test_an_fsdp_group_of_four_takes_each_train_task_on_all_four_ranks_at_once():
    cost = replace(uniform_model(workers=6, tasks=8, gen=1.0, train=2.0), fsdp_group=True)
    roles = split(cost, 2)
    trainers = {n for n, r in roles.items() if r is Role.TRAINER}
    res = simulate(cost, MODES["digen"], roles, iterations=4, warmup=1, trailing=1)
    by_span: dict[tuple[float, float], set[str]] = {}
    for r in _train_rows(res):
        by_span.setdefault((r["start"], r["end"]), set()).add(r["worker"])
    assert by_span and all(workers == trainers for workers in by_span.values())
    assert len(by_span) == 4 * 8  # one span per task: 8 tasks of 4 iterations
    spans = sorted(by_span)
    assert all(a[1] <= b[0] + 1e-12 for a, b in zip(spans, spans[1:], strict=False))  # one at a time
    # digen mode, yet the group only trains and the rollout workers only generate
    assert {r["worker"] for r in res.rows if r["kind"] == "gen"} <= set(roles) - trainers
    # replicated trainers (no group) run four tasks side by side instead
    apart = simulate(replace(cost, fsdp_group=False), MODES["disagg+gap"], roles, iterations=4, warmup=1)
    assert any(len(v) < len(trainers) for v in _spans(apart).values())


def _spans(res):
    out: dict[tuple[float, float], set[str]] = {}
    for r in _train_rows(res):
        out.setdefault((r["start"], r["end"]), set()).add(r["worker"])
    return out


def test_a_rank_trains_its_share_of_the_tasks_rows_in_the_runtimes_passes():
    cost = load_sim_config(CONFIGS / "verl-omni-full-h200.yaml").cost
    assert cost.fsdp_group
    p = cost.workers[0].cost.passes
    assert (p.samples, p.steps, p.rows_per_forward) == (1, 2, 64)
    # 8 one-sample micro-batches x K=2: 16 rows, 3 ranks: the busiest takes 6
    assert p.rank_sizes(8, True, 3) == [6]
    assert p.rank_sizes(8, False, 3) == [3, 3]  # sample-major rows: both steps, one pass each
    assert p.rank_sizes(512, True, 28) == [37]
    assert p.rank_sizes(512, True, 4) == [64, 64, 64, 64]
    assert p.rank_sizes(1, True, 4) == [1]  # two rows, four ranks: one row at most
    for gpt in (1, 8, 64):
        for tsp in (True, False):
            assert p.rank_sizes(gpt, tsp, 1) == p.sizes(gpt, tsp)
    c = cost.workers[0].cost
    want = _pass_s(p.compute_s(6, True), c.train_gather_s, c.layers)
    assert c.group_task_s(8, True, 3) == pytest.approx(want, rel=1e-12)


def test_the_simulated_group_trains_in_the_group_tasks_seconds():
    setup = load_sim_config(CONFIGS / "verl-omni-full-h200.yaml")
    cost = replace(setup.cost, groups_per_task=8)
    roles = roles_for(worker_order(cost), 1)
    res = simulate(cost, MODES["digen"], roles, iterations=3, warmup=1, trailing=1)
    group = [w for w in cost.workers if roles[w.name] is Role.TRAINER]
    want = cost.group_task_s(group, 8, True)
    spans = _spans(res)
    assert len(spans) == 3 * 512 // 8
    assert all(len(v) == 3 for v in spans.values())
    assert all(e - s == pytest.approx(want) for s, e in spans)


def test_the_bound_trains_as_one_group_and_no_mode_beats_it():
    cost = load_sim_config(CONFIGS / "verl-omni-full-h200.yaml").cost
    bound = costmodel_bound(cost)
    names = [w.name for w in cost.workers]
    rates = [cost.rates(w) for w in cost.workers]
    by_split = [
        min(sum(g for g, _ in rates[:r]), cost.group_rate(set(names[r:]))) for r in range(1, len(names))
    ]
    assert bound.x == pytest.approx(max(by_split))
    assert sum(bound.fractions) == 1 + by_split.index(max(by_split))
    # the ranks as replicas (the LP, every trainer its own tasks) would promise far more
    assert bound.x < 0.5 * lp_bound([g for g, _ in rates], [t for _, t in rates]).x
    for r in (1, 2, 3):
        res = simulate(cost, MODES["digen"], roles_for(worker_order(cost), r), iterations=3, warmup=1)
        assert res.samples_per_s <= bound.x * (1 + 1e-9)
