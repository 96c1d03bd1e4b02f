"""scripts/bench_algorithms.py's statistics: 95% Student t intervals over seeds, and verdicts
only where intervals do not overlap."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_algorithms.py"


@pytest.fixture(scope="module")
def ba():
    spec = importlib.util.spec_from_file_location("bench_algorithms", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_mean_ci_uses_student_t_with_n_minus_1_dof(ba):
    # 1, 2, 3: mean 2, sample sd 1, t(0.975, 2) = 4.303 -> half-width 4.303 / sqrt(3)
    m, h = ba.mean_ci([1.0, 2.0, 3.0])
    assert m == 2.0
    assert h == pytest.approx(4.303 / math.sqrt(3))  # 2.4843
    # 10, 12, 14, 16: mean 13, sd sqrt(20/3), t(0.975, 3) = 3.182 -> 3.182 * sqrt(20/3) / 2
    m, h = ba.mean_ci([10.0, 12.0, 14.0, 16.0])
    assert m == 13.0
    assert h == pytest.approx(4.1080, abs=1e-4)


def test_mean_ci_of_one_value_has_no_interval_and_equal_values_zero_width(ba):
    m, h = ba.mean_ci([0.25])
    assert m == 0.25 and math.isnan(h)
    assert ba.mean_ci([5.0, 5.0, 5.0]) == (5.0, 0.0)
    with pytest.raises(ValueError):
        ba.mean_ci([])


def test_t_quantiles(ba):
    assert ba.t95(1) == 12.706
    assert ba.t95(2) == 4.303
    assert ba.t95(9) == 2.262
    assert ba.t95(100) == ba.t95(30) == 2.042  # beyond the table: the (wider) value for 30
    with pytest.raises(ValueError):
        ba.t95(0)


def test_separated_only_when_intervals_do_not_overlap(ba):
    assert ba.separated((10.0, 1.0), (5.0, 1.0)) == 1
    assert ba.separated((5.0, 1.0), (10.0, 1.0)) == -1
    assert ba.separated((10.0, 3.0), (5.0, 3.0)) == 0  # 7..13 and 2..8 overlap
    assert ba.separated((10.0, math.nan), (5.0, 0.1)) == 0  # n = 1: no verdict


def run(name: str, seed: int, gain: float, sps: float) -> dict:
    return {
        "algorithm": name,
        "seed": seed,
        "gain": gain,
        "samples_per_s": sps,
        "first": 0.4,
        "last": 0.4 + gain,
    }


def test_summary_table_and_verdicts(ba):
    runs = [
        *(run("a", s, g, v) for s, (g, v) in enumerate([(0.20, 50), (0.22, 52), (0.24, 54)])),
        *(run("b", s, g, v) for s, (g, v) in enumerate([(-0.05, 49), (0.0, 55), (0.05, 61)])),
        run("c", 0, 0.9, 200),
    ]
    rows = ba.summarize(runs)
    assert [(r["algorithm"], r["n"], r["seeds"]) for r in rows] == [
        ("a", 3, [0, 1, 2]),
        ("b", 3, [0, 1, 2]),
        ("c", 1, [0]),
    ]
    a, b, c = rows
    assert a["gain"][0] == pytest.approx(0.22)
    assert a["gain"][1] == pytest.approx(4.303 * 0.02 / math.sqrt(3))
    assert b["samples_per_s"] == pytest.approx((55.0, 4.303 * 6 / math.sqrt(3)))
    said = ba.verdicts(rows)
    # a's gain interval excludes 0 and lies above b's; b's includes 0; samples/s overlap;
    # c (n = 1) gets no verdict at all
    assert said == [
        "a gained reward (gain +0.220 ± 0.050, n=3).",
        "a had a larger reward gain than b.",
    ]
    lines = ba.table(rows)
    assert lines[2] == "| a | 3 (0,1,2) | +0.220 ± 0.050 | 52.0 ± 5.0 | 0.400 -> 0.620 |"
    assert lines[4] == "| c | 1 (0) | +0.900 | 200.0 | 0.400 -> 1.300 |"
