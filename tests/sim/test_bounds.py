"""The throughput bounds: zero-bubble and the exact 2-constraint LP for mixed GPUs."""

from __future__ import annotations

import itertools
import random

import pytest

from digen.sim.bounds import costmodel_bound, lp_bound, zero_bubble_bound
from digen.sim.costmodel import CostModel, SimWorker, WorkerCost


def test_identical_workers_match_the_zero_bubble_bound():
    # 4 workers, 2 s to generate and 3 s to train a sample: (G + T) / N = 5/4 s per sample
    sol = lp_bound([0.5] * 4, [1 / 3] * 4)
    assert sol.x == pytest.approx(4 / 5)
    assert zero_bubble_bound(2.0, 3.0, 4) == pytest.approx(1.25)
    assert sum(sol.fractions) == pytest.approx(4 * 2 / 5)  # 40% of the time generating


def test_specialists_each_do_what_they_are_best_at():
    sol = lp_bound([4.0, 1.0], [1.0, 4.0])
    assert sol.x == pytest.approx(4.0)
    assert sol.fractions == pytest.approx([1.0, 0.0])


def test_one_worker_is_split_fractionally():
    # worker 0 is the better generator (g/t = 3 vs 0.5): worker 1 only trains and worker 0
    # splits its time so both sides match: 3 f0 = (1 - f0) * 1 + 2  ->  f0 = 3/4, X = 9/4
    sol = lp_bound([3.0, 1.0], [1.0, 2.0])
    assert sol.x == pytest.approx(9 / 4)
    assert sol.fractions == pytest.approx([0.75, 0.0])


def test_lp_is_optimal_against_a_grid_search():
    rng = random.Random(0)
    grid = [i / 20 for i in range(21)]
    for _ in range(20):
        g = [rng.uniform(0.1, 3) for _ in range(3)]
        t = [rng.uniform(0.1, 3) for _ in range(3)]
        sol = lp_bound(g, t)
        gen = sum(f * gi for f, gi in zip(sol.fractions, g, strict=True))
        train = sum((1 - f) * ti for f, ti in zip(sol.fractions, t, strict=True))
        assert gen >= sol.x - 1e-9 and train >= sol.x - 1e-9
        best = max(
            min(
                sum(f * gi for f, gi in zip(fs, g, strict=True)),
                sum((1 - f) * ti for f, ti in zip(fs, t, strict=True)),
            )
            for fs in itertools.product(grid, repeat=3)
        )
        assert best <= sol.x + 1e-9
        assert sol.x - best < 0.1 * sol.x


def test_a_worker_that_cannot_train_only_generates():
    sol = lp_bound([1.0, 1.0], [0.0, 1.0])
    assert sol.fractions[0] == 1.0
    assert sol.x == pytest.approx(1.0)


def test_costmodel_bound_uses_rollout_and_tsp_rates():
    wc = WorkerCost(gen_s=1.5, decode_s=0.3, reward_s=0.2, train_s=9.0, train_tsp_s=3.0, gen_on_trainer_s=1.5)
    cm = CostModel([SimWorker(f"w{i}", "x", 1, wc) for i in range(2)], tasks=4, samples_per_task=2)
    # per task 2 s generating + 3 s training, 2 samples, 2 workers: 2 * 2 / 5 samples/s
    assert costmodel_bound(cm).x == pytest.approx(0.8)
