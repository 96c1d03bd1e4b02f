"""The bench's zero-bubble bound is flagged when it cannot hold."""

from __future__ import annotations

from digen.bench.report import _of_bound
from digen.bench.stats import WorkerStats
from digen.bench.summary import bound_validity


def _workers(n: int, busy: float, window: float = 10.0) -> dict[str, WorkerStats]:
    return {f"w{i}": WorkerStats(f"w{i}", "rollout", "cpu", busy_s=busy, window_s=window) for i in range(n)}


def test_a_machine_with_more_busy_workers_than_cores_flags_the_bound():
    v = bound_validity(30.0, 33.4, _workers(4, busy=9.0), cores=2)
    assert not v["bound_valid"] and "oversubscribed" in v["bound_warning"]
    assert v["busy_workers"] == 3.6


def test_a_fraction_above_one_is_never_unflagged():
    v = bound_validity(62.4, 33.4, _workers(2, busy=5.0), cores=8)
    assert not v["bound_valid"] and "above the bound" in v["bound_warning"]
    row = {"fraction_of_bound": 62.4 / 33.4, **v}
    assert _of_bound(row) == "187% (invalid)"


def test_a_bound_measured_on_free_cores_holds():
    v = bound_validity(30.0, 33.4, _workers(2, busy=8.0), cores=4)
    assert v["bound_valid"] and v["bound_warning"] is None
    assert _of_bound({"fraction_of_bound": 30 / 33.4, **v}) == "90%"
