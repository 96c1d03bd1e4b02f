"""The bench's zero-bubble bound: from the tasks' CPU seconds where the workers share cores,
flagged when it still cannot hold."""

from __future__ import annotations

from pathlib import Path

import pytest

from digen.bench.report import _of_bound, markdown_table
from digen.bench.stats import RatePool, RunRecord, WorkerStats, worker_stats
from digen.bench.summary import bound_validity, choose_bound, summarize


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


# --- the bound from the tasks' CPU seconds where the workers share cores ---------------------
G = 4  # group size


def _row(worker: str, role: str, kind: str, k: int, s: float, e: float, cpu: float | None) -> dict:
    row = {"worker": worker, "gpu_type": "cpu", "role": role, "kind": kind, "iteration": k, "version": k}
    row |= {"start": s, "end": e}
    return row if cpu is None else row | {"cpu_s": cpu}


def crowded_run(iterations: int = 4, cpu: bool = True) -> RunRecord:
    """Two rollout and two trainer workers, all four busy for the whole of every 1.4 s
    iteration on a machine that gives each half a core: a group's generation takes 1.4 s of
    wall time and 0.7 s of CPU (gen 1.0 / 0.5, decode and reward 0.2 / 0.1 each), a train
    task the same. Wall rates: 4 / 1.4 samples/s per worker; per CPU second: 4 / 0.7."""
    rows, t = [], 0.0
    for k in range(iterations):
        for w in ("rollout-0", "rollout-1"):
            s = t
            for kind, d in (("gen", 1.0), ("decode", 0.2), ("reward", 0.2)):
                rows.append(_row(w, "rollout", kind, k, s, s + d, d / 2 if cpu else None))
                s += d
        for w in ("trainer-0", "trainer-1"):
            rows.append(_row(w, "trainer", "train", k, t, t + 1.4, 0.7 if cpu else None))
        rows.append(_row("controller", "controller", "optim", k, t + 1.4, t + 1.4, None))
        t += 1.4
    metrics = [
        {"iteration": k, "samples": 2 * G, "wall_s": 1.4, "samples_per_s": 2 * G / 1.4}
        for k in range(iterations)
    ]
    return RunRecord("digen", 0, Path("d"), metrics, rows, False)


def _summary(rec: RunRecord, cores: int) -> dict:
    pool = RatePool()
    for st in worker_stats(rec.timeline, 1).values():
        pool.add_worker(st, rec.tsp, G)
    return summarize("digen", [rec], pool, G, 1, cores=cores)


def test_an_oversubscribed_machine_takes_the_bound_from_cpu_seconds():
    s = _summary(crowded_run(), cores=2)
    assert s["busy_workers"] == pytest.approx(4.0)
    # each worker: g = t = 4 / 0.7 per CPU second; the LP over 4 identical workers: 4 x r / 2
    assert s["bound_source"] == "cpu"
    assert s["bound_samples_per_s"] == pytest.approx(2 * G / 0.7)
    assert s["bound_samples_per_s_wall"] == pytest.approx(2 * G / 1.4)  # what the durations give
    assert s["fraction_of_bound"] == pytest.approx(0.5)
    assert s["bound_valid"] and s["bound_warning"] is None
    workers = {w["worker"]: w for w in s["per_worker"]}
    assert workers["rollout-0"]["gen_samples_per_cpu_s"] == pytest.approx(G / 0.7, abs=1e-4)
    assert workers["rollout-0"]["gen_samples_per_s"] == pytest.approx(G / 1.4, abs=1e-4)
    assert _of_bound(s) == "50% (CPU time)"
    table = markdown_table([s], [])
    assert "| 50% (CPU time) |" in table and "Bound for digen from the tasks' CPU seconds" in table


def test_the_same_run_with_free_cores_keeps_the_wall_clock_bound():
    s = _summary(crowded_run(), cores=8)
    assert s["bound_source"] == "wall" and s["bound_valid"]
    assert s["bound_samples_per_s"] == pytest.approx(2 * G / 1.4)
    assert s["bound_samples_per_s_cpu"] == pytest.approx(2 * G / 0.7)  # reported beside it


def test_an_oversubscribed_run_without_cpu_seconds_is_flagged():
    s = _summary(crowded_run(cpu=False), cores=2)
    assert s["bound_samples_per_s_cpu"] is None and s["bound_source"] == "wall"
    assert not s["bound_valid"] and "recorded no CPU time" in s["bound_warning"]
    assert _of_bound(s) == "100% (invalid)"


def test_a_wall_bound_beaten_on_free_cores_falls_back_to_cpu_and_a_cpu_bound_beaten_is_flagged():
    few = _workers(2, busy=5.0)
    # other processes took the cores: the workers' count says nothing, the throughput does
    v = choose_bound(62.4, 33.4, 70.0, few, cores=8)
    assert v["bound_source"] == "cpu" and v["bound_valid"]
    assert v["fraction_of_bound"] == pytest.approx(62.4 / 70.0)
    # the last resort: above even the CPU-time bound, flagged, never an unflagged fraction above 1
    v = choose_bound(80.0, 33.4, 70.0, few, cores=8)
    assert not v["bound_valid"] and "above the CPU-time bound" in v["bound_warning"]
    assert _of_bound(v) == "114% (invalid)"
    v = choose_bound(62.4, 33.4, None, few, cores=8)  # no CPU seconds recorded
    assert v["bound_source"] == "wall" and not v["bound_valid"]
