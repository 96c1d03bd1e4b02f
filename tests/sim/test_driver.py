"""The discrete-event driver runs the real Scheduler: exact timings on uniform workers, and
the invariants of each mode (staleness, sibling wait, TAG budgets, static shares)."""

from __future__ import annotations

from collections import Counter

import pytest

from digen.core.events import Role
from digen.errors import ConfigError, DigenError
from digen.sim.driver import MODES, parse_modes, simulate, time_shares
from tests.sim.conftest import split, uniform_model


def test_colocated_iteration_is_generate_then_train_then_step():
    # 8 tasks on 4 workers: 2 rounds of 1 s generation, 2 rounds of 2 s training, 0.1 s step
    res = simulate(uniform_model(), MODES["colocated-digen"], iterations=3, warmup=1)
    assert res.s_per_iteration == pytest.approx(6.1)
    assert res.samples_per_s == pytest.approx(8 / 6.1)
    assert res.bubble_ratio == pytest.approx(0.1 / 6.1)


def test_synchronous_disaggregation_idles_each_side_while_the_other_works():
    cost = uniform_model()
    res = simulate(cost, MODES["disaggregated"], split(cost, 2), iterations=3, warmup=1)
    # 4 rounds of generation on 2 rollouts, 4 rounds of training on 2 trainers, step + sync
    assert res.s_per_iteration == pytest.approx(4 + 8 + 0.2)
    assert res.bubble_ratio == pytest.approx(1 - (8 + 16) / (4 * 12.2))


def test_peers_colocated_pays_offload_and_recompute_and_keeps_static_shares():
    from dataclasses import replace

    cost = uniform_model(workers=3, tasks=7)
    wc = replace(cost.workers[0].cost, recompute_s=0.5, phase_switch_s=0.25)
    cost.workers = [replace(w, cost=wc) for w in cost.workers]
    res = simulate(cost, MODES["colocated"], iterations=3, warmup=1)
    per_worker = Counter(r["worker"] for r in res.rows if r["kind"] == "gen" and r["iteration"] == 1)
    assert per_worker == {"w0": 3, "w1": 2, "w2": 2}  # task g belongs to worker g mod 3
    # w0 gates: 3 x 1 s gen, switch, 3 x (0.5 + 2) s train, switch back next iteration, step
    assert res.s_per_iteration == pytest.approx(3 + 0.25 + 7.5 + 0.1 + 0.25)
    shares = time_shares(res)
    assert shares["recompute"] > 0 and shares["offload/reload"] > 0


def test_staleness_is_zero_when_synchronous_and_at_most_one_in_digen():
    cost = uniform_model(tasks=8)
    for name, lag in (("disagg+gap", 0), ("digen", 1)):
        res = simulate(cost, MODES[name], split(cost, 2), iterations=4, warmup=1)
        lags = {r["iteration"] - r["version"] for r in res.rows if r["kind"] == "gen"}
        assert max(lags) == lag


def test_async_overlaps_next_generation_with_training():
    cost = uniform_model(tasks=8, gen=2.0, train=2.0)
    sync = simulate(cost, MODES["disagg+gap"], split(cost, 2), iterations=5, warmup=2)
    asyn = simulate(cost, MODES["digen"], split(cost, 2), iterations=5, warmup=2)
    assert asyn.samples_per_s > 1.2 * sync.samples_per_s


def test_training_waits_for_every_micro_batch_of_its_prompt_group():
    cost = uniform_model(workers=4, tasks=8, per_group=4)
    res = simulate(cost, MODES["disagg+gap"], split(cost, 3), iterations=2, warmup=1, trailing=0)
    first_train = min(r["start"] for r in res.rows if r["kind"] == "train" and r["iteration"] == 0)
    # 3 rollouts: tasks 0-2 end at 1 s, task 3 (same group) at 2 s; training starts at 2 s
    assert first_train == pytest.approx(2.0)


def test_tag_lets_idle_trainers_generate_when_generation_is_the_bottleneck():
    cost = uniform_model(workers=8, tasks=32, gen=3.0, train=1.0, per_group=4)
    roles = split(cost, 4)
    plain = simulate(cost, MODES["disagg+gap+tsp"], roles, iterations=3, warmup=1)
    tag = simulate(cost, MODES["disagg+gap+tsp+tag"], roles, iterations=3, warmup=1)
    stolen = [r for r in tag.rows if r["kind"] == "gen" and r["role"] == "trainer"]
    assert stolen and all(r["iteration"] >= 1 for r in stolen)  # budgets come from measured speeds
    assert not [r for r in plain.rows if r["kind"] == "gen" and r["role"] == "trainer"]
    assert tag.step_ends[1] - tag.step_ends[0] < plain.step_ends[1] - plain.step_ends[0]


def test_tag_stays_off_when_training_is_the_bottleneck():
    cost = uniform_model(workers=8, tasks=32, gen=1.0, train=3.0, per_group=4)
    res = simulate(cost, MODES["disagg+gap+tsp+tag"], split(cost, 2), iterations=3, warmup=1)
    assert not [r for r in res.rows if r["kind"] == "gen" and r["role"] == "trainer"]


def test_weight_loads_are_charged_when_the_version_changes():
    cost = uniform_model(load=0.5)
    res = simulate(cost, MODES["disaggregated"], split(cost, 2), iterations=3, warmup=1)
    loads = [r for r in res.rows if r.get("part") == "weights load"]
    assert loads and all(r["end"] - r["start"] == pytest.approx(0.5) for r in loads)
    assert res.s_per_iteration == pytest.approx(4 + 8 + 0.2 + 2 * 0.5)  # one load per side


def test_a_mode_without_trainers_stalls_with_a_clear_error():
    cost = uniform_model()
    with pytest.raises(DigenError, match="stalled"):
        simulate(cost, MODES["disaggregated"], split(cost, 4), iterations=2, warmup=1, trailing=0)


def test_disaggregated_needs_a_role_per_worker_and_modes_are_validated():
    with pytest.raises(ConfigError):
        simulate(uniform_model(), MODES["digen"], {"w0": Role.ROLLOUT})
    with pytest.raises(ConfigError, match="unknown mode"):
        parse_modes("colocated,nope")
    assert "disagg+async" in parse_modes("all")


def test_tag_budget_is_renewed_every_iteration():
    cost = uniform_model(workers=8, tasks=32, gen=3.0, train=1.0, per_group=4)
    res = simulate(cost, MODES["digen"], split(cost, 4), iterations=5, warmup=1)
    stolen = Counter(r["iteration"] for r in res.rows if r["kind"] == "gen" and r["role"] == "trainer")
    assert all(stolen[i] > 0 for i in range(2, 5)), stolen
