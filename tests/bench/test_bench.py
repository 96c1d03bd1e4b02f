"""digen bench: the zero-bubble bound, mode parsing, reading runs, the table; one small real bench."""

from __future__ import annotations

import itertools
import json
import os
import random
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from digen.bench import (
    RatePool,
    RunRecord,
    add_speedups,
    bubble_by_role,
    markdown_table,
    measured_window,
    mode_config,
    parse_modes,
    parse_workers,
    peak_rss_mb,
    summarize,
    worker_stats,
)
from digen.config import build_config
from digen.errors import ConfigError
from digen.sim.bounds import lp_bound
from tests.conftest import required

G = 4  # group size of the synthetic runs


# --- the bound the bench reports (digen.sim.bounds.lp_bound) ---------------------------------
def zero_bubble_bound(g, t):
    sol = lp_bound(list(g), list(t))
    return sol.x, sol.fractions


def test_identical_workers_meet_the_closed_form():
    x, f = zero_bubble_bound([8.0, 8.0], [16.0, 16.0])
    assert x == pytest.approx(2 * 8 * 16 / (8 + 16))  # (G + T) / N in time terms
    assert sum(f) == pytest.approx(2 * 16 / 24)


def test_specialists():
    assert zero_bubble_bound([10.0, 0.0], [0.0, 5.0])[0] == pytest.approx(5.0)
    assert zero_bubble_bound([0.0], [3.0])[0] == 0.0
    assert zero_bubble_bound([], [])[0] == 0.0


def test_bound_is_optimal_against_a_grid_search():
    rng = random.Random(0)
    steps = [i / 20 for i in range(21)]
    for _ in range(30):
        g = [rng.uniform(0.5, 10) for _ in range(3)]
        t = [rng.uniform(0.5, 10) for _ in range(3)]
        x, f = zero_bubble_bound(g, t)
        # the fractions returned reach x and are feasible
        assert all(0 <= fi <= 1 for fi in f)
        assert sum(fi * gi for fi, gi in zip(f, g, strict=True)) >= x - 1e-9
        assert sum((1 - fi) * ti for fi, ti in zip(f, t, strict=True)) >= x - 1e-9
        # and no point of a 21^3 grid does better
        best = max(
            min(
                sum(a * b for a, b in zip(fs, g, strict=True)),
                sum((1 - a) * b for a, b in zip(fs, t, strict=True)),
            )
            for fs in itertools.product(steps, repeat=3)
        )
        assert best <= x + 1e-9
        assert x - best < 0.05 * x  # the grid comes close, so x is not an overestimate of a wrong LP


# --- modes -------------------------------------------------------------------------------
def test_parse_modes_and_mode_config():
    assert parse_modes("reference, digen,digen-tag+gap") == ["reference", "digen", "digen-tag+gap"]
    for bad in ("", "fast", "digen-warp", "reference-tag", "digen,digen"):
        with pytest.raises(ConfigError):
            parse_modes(bad)
    cfg = build_config(required({"iterations": 4}), check_paths=False)
    s = mode_config(cfg, "digen-tag-async", (2, 3)).schedule.resolved()
    assert (s.mode, s.gap, s.tsp, s.tag, s.max_staleness) == ("digen", True, True, False, 0)
    c = mode_config(cfg, "disaggregated+tsp", (2, 3))
    assert c.schedule.resolved().tsp is True and c.schedule.resolved().gap is False
    assert (c.cluster.local.rollout_workers, c.cluster.local.trainer_workers) == (2, 3)
    assert c.output.checkpoint_every == 4 and c.output.sample_grid_every == 0
    assert parse_workers("1,2") == (1, 2) and parse_workers(None) is None
    with pytest.raises(ConfigError):
        parse_workers("2")


def test_a_mode_at_a_max_batch_runs_it_and_is_compared_with_colocated_at_the_same():
    assert parse_modes("digen@4,colocated@4,colocated") == ["digen@4", "colocated@4", "colocated"]
    for bad in ("digen@0", "digen@x", "digen@"):
        with pytest.raises(ConfigError, match="max_batch"):
            parse_modes(bad)
    cfg = build_config(required({"iterations": 4}), check_paths=False)
    c = mode_config(cfg, "digen-tag@4")
    assert c.rollout.max_batch == 4 and c.schedule.resolved().tag is False
    assert mode_config(cfg, "digen").rollout.max_batch == cfg.rollout.max_batch
    rows = [
        {"mode": m, "samples_per_s": s}
        for m, s in [("colocated", 2.0), ("colocated@4", 4.0), ("digen@4", 6.0), ("digen@2", 6.0)]
    ]
    add_speedups(rows)
    assert [r["speedup_vs_colocated"] for r in rows] == [1.0, 1.0, 1.5, 3.0]  # digen@2: no colocated@2


# --- reading runs --------------------------------------------------------------------------
def _row(worker, role, kind, k, s, e, version=None):
    return {
        "worker": worker,
        "gpu_type": "cpu",
        "role": role,
        "kind": kind,
        "iteration": k,
        "version": k if version is None else version,
        "start": s,
        "end": e,
    }


def reference_timeline(iterations=3, t0=0.0):
    """Per iteration: 2 groups x (gen 0.3 + decode 0.1 + reward 0.1), 2 trains of 0.25, optim 0.05
    (iteration 0 also loads the model for 5 s): g = 4/0.5 = 8, t = 4/0.25 = 16 samples/s."""
    rows, t = [], t0
    for k in range(iterations):
        if k == 0:
            rows.append(_row("reference", "reference", "gen", 0, t, t + 5.0))  # a slow first gen
            rows += [
                _row("reference", "reference", "decode", 0, t + 5.0, t + 5.1),
                _row("reference", "reference", "reward", 0, t + 5.1, t + 5.2),
            ]
            t += 5.2
        for _ in range(2 if k else 1):
            for kind, d in (("gen", 0.3), ("decode", 0.1), ("reward", 0.1)):
                rows.append(_row("reference", "reference", kind, k, t, t + d))
                t += d
        for _ in range(2):
            rows.append(_row("reference", "reference", "train", k, t, t + 0.25))
            t += 0.25
        rows.append(_row("reference", "reference", "optim", k, t, t + 0.05))
        t += 0.05
    return rows


def disaggregated_timeline(iterations=3):
    """rollout-0 generates 2 groups (1.0 s), then trainer-0 trains them (0.5 s), then the
    controller steps (0.1 s): iteration = 1.6 s; rollout busy 1.0, trainer busy 0.5."""
    rows, t = [], 0.0
    for k in range(iterations):
        for _ in range(2):
            for kind, d in (("gen", 0.3), ("decode", 0.1), ("reward", 0.1)):
                rows.append(_row("rollout-0", "rollout", kind, k, t, t + d))
                t += d
        rows.append(_row("trainer-0", "trainer", "sync", k, t, t + 0.05))
        for _ in range(2):
            rows.append(_row("trainer-0", "trainer", "train", k, t, t + 0.25))
            t += 0.25
        rows += [
            _row("controller", "controller", "optim", k, t, t + 0.05),
            _row("controller", "controller", "sync", k, t + 0.05, t + 0.1),
        ]
        t += 0.1
    return rows


def metrics(iterations, wall, busy, workers):
    return [
        {
            "iteration": k,
            "samples": 8,
            "wall_s": wall,
            "samples_per_s": 8 / wall,
            "busy_s": busy,
            "worker_s": workers * wall,
        }
        for k in range(iterations)
    ]


def test_worker_stats_skip_the_warmup_iteration():
    rows = reference_timeline()
    lo, hi = measured_window(rows, 1)
    assert lo == pytest.approx(5.2 + 0.5 + 0.5 + 0.05)  # end of iteration 0's optimizer step
    assert hi == pytest.approx(rows[-1]["end"])
    st = worker_stats(rows, warmup=1)["reference"]
    assert (st.gen_groups, st.train_groups) == (4, 4)
    assert st.gen_rate(G) == pytest.approx(8.0)
    assert st.train_rate(G) == pytest.approx(16.0)
    assert st.busy_s == pytest.approx(hi - lo)  # never idle
    with_warmup = worker_stats(rows, warmup=0)["reference"]
    assert with_warmup.gen_rate(G) < 8.0  # the slow first generation counts only with --warmup 0


def test_bubble_by_role_and_controller_excluded():
    stats = worker_stats(disaggregated_timeline(), warmup=1)
    assert set(stats) == {"rollout-0", "trainer-0"}
    b = bubble_by_role(stats)
    assert b["rollout"] == pytest.approx(1 - 2.0 / 3.2)
    assert b["trainer"] == pytest.approx(1 - 1.0 / 3.2)  # the trainer's sync is not busy time


def test_summarize_pools_rates_a_worker_never_measured():
    ref = RunRecord(
        "reference",
        0,
        Path("r"),
        metrics(3, 1.55, 1.55, 1),
        reference_timeline(),
        False,
        {"reference": 500.0, "controller": 500.0},
    )
    dis = RunRecord(
        "disaggregated",
        0,
        Path("d"),
        metrics(3, 1.6, 1.2, 2),
        disaggregated_timeline(),
        False,
        {"rollout-0": 700.0, "trainer-0": 800.0, "controller": 300.0},
    )
    pool = RatePool()
    for rec in (ref, dis):
        for st in worker_stats(rec.timeline, 1).values():
            pool.add(st.gpu_type, "gen", rec.tsp, st.gen_rate(G))
            pool.add(st.gpu_type, "train", rec.tsp, st.train_rate(G))
    rows = [summarize("reference", [ref], pool, G, 1), summarize("disaggregated", [dis], pool, G, 1)]
    add_speedups(rows)
    r, d = rows
    assert r["samples_per_s"] == pytest.approx(8 / 1.55) and r["s_per_iteration"] == pytest.approx(1.55)
    assert r["bound_samples_per_s"] == pytest.approx(8 * 16 / 24)
    assert d["bubble_ratio"] == pytest.approx(1 - 3.0 / 6.4)  # from the timeline: 2 workers x 3.2 s
    assert d["bubble_ratio_metrics"] == pytest.approx(1 - 1.2 / 3.2)  # as the controller logged it
    workers = {w["worker"]: w for w in d["per_worker"]}
    assert workers["rollout-0"]["train_rate_source"] == "pooled"
    assert workers["rollout-0"]["train_samples_per_s"] == pytest.approx(16.0)
    assert workers["trainer-0"]["gen_samples_per_s"] == pytest.approx(8.0)
    assert workers["trainer-0"]["peak_rss_mb"] == 800.0
    assert d["bound_samples_per_s"] == pytest.approx(2 * 8 * 16 / 24)
    assert d["fraction_of_bound"] == pytest.approx(d["samples_per_s"] / d["bound_samples_per_s"])
    assert d["speedup_vs_disaggregated"] == pytest.approx(1.0)
    assert r["speedup_vs_disaggregated"] == pytest.approx(1.6 / 1.55)
    assert r["speedup_vs_colocated"] is None
    table = markdown_table(
        rows,
        [{"K": 4, "rows": 16, "batched_ms_per_row": 1.0, "sequential_ms_per_row": 3.0, "speedup": 3.0}],
        command="digen bench x.yaml",
    )
    assert "`digen bench x.yaml`" in table
    assert "| disaggregated | 2 | 1.600 | 5.00 | 0.53 | rollout 0.38, trainer 0.69 | n/a" in table
    assert "| 4 | 16 | 1.00 | 3.00 | 3.00x |" in table
    with pytest.raises(ConfigError, match="warmup"):
        summarize("reference", [ref], pool, G, 5)


def test_peak_rss_of_this_process():
    assert peak_rss_mb(os.getpid()) > 10


# --- end to end ------------------------------------------------------------------------------
@pytest.mark.slow
def test_cli_bench_reference_and_digen(tiny_sd3, tmp_path):
    from digen.cli.main import app
    from tests.conftest import small_config_data

    cfg = tmp_path / "bench.yaml"
    cfg.write_text(yaml.safe_dump(small_config_data(tiny_sd3, iterations=2)))
    out = tmp_path / "out"
    res = CliRunner().invoke(
        app,
        [
            "bench",
            str(cfg),
            "--modes",
            "reference,digen",
            "--rounds",
            "1",
            "--tsp-k",
            "1,2",
            "--batch-sizes",
            "1,2",
            "--set",
            "rollout.max_batch=2",  # digen's rollout worker runs the iteration's two groups as one batch
            "--out",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output
    rows = json.loads((out / "bench.json").read_text())
    assert [r["mode"] for r in rows] == ["reference", "digen"]
    for r in rows:
        for key in (
            "s_per_iteration",
            "samples_per_s",
            "bubble_ratio",
            "speedup_vs_colocated",
            "fraction_of_bound",
            "bound_samples_per_s",
            "per_worker",
        ):
            assert key in r
        assert r["samples_per_s"] > 0 and r["bound_samples_per_s"] > 0
        assert r["fraction_of_bound"] <= 1 or r["bound_warning"]  # never above 1 unflagged
        assert all(w["peak_rss_mb"] and w["peak_rss_mb"] > 50 for w in r["per_worker"])
        # every timed task recorded its CPU seconds: the bound for a machine short of cores
        assert r["bound_samples_per_s_cpu"] is not None and r["bound_samples_per_s_cpu"] > 0
    assert {w["worker"] for w in rows[1]["per_worker"]} == {"rollout-0", "trainer-0"}
    per = {w["worker"]: w for w in rows[1]["per_worker"]}
    assert per["rollout-0"]["gen_samples_per_cpu_s"] > 0 and per["trainer-0"]["train_samples_per_cpu_s"] > 0
    tsp = json.loads((out / "tsp.json").read_text())
    assert [t["K"] for t in tsp] == [1, 2] and all(t["batched_s"] > 0 for t in tsp)
    batching = json.loads((out / "batching.json").read_text())
    assert [(b["max_batch"], b["samples"]) for b in batching] == [(1, 4), (2, 8)]
    assert all(b["ms_per_sample"] > 0 and b["peak_rss_mb"] > 50 for b in batching)
    md = (out / "bench.md").read_text()
    assert md.startswith("`digen bench ") and "| digen | 2 |" in md
    assert "--batch-sizes 1,2" in md and "| max_batch | samples | ms/sample |" in md
    assert "| digen | 2 |" in res.output
    # progress: a line per step as it starts (not a terminal), each run's result after it
    steps = [line for line in res.stderr.splitlines() if line.startswith("bench: step ")]
    assert steps == [
        "bench: step 1/4 round 1/1 reference",
        "bench: step 2/4 round 1/1 digen",
        "bench: step 3/4 TSP micro-benchmark, K in [1, 2]",
        "bench: step 4/4 generation-batching micro-benchmark, max_batch in [1, 2]",
    ]
    lines = res.stderr.splitlines()
    assert lines.index(steps[0]) < next(i for i, x in enumerate(lines) if "round 1/1 reference:" in x)


def test_summarize_reports_the_worker_loops_redis_round_trips():
    timeline = disaggregated_timeline()
    for row in timeline:  # the loops mark each task's last event (iteration 0 is warm-up)
        if row["kind"] == "reward":
            row.update(redis_round_trips=6, cycles=3)
        elif row["kind"] == "train":
            row.update(redis_round_trips=4, cycles=2)
    rec = RunRecord("disaggregated", 0, Path("d"), metrics(3, 1.6, 1.2, 2), timeline, False, {})
    pool = RatePool()
    d = summarize("disaggregated", [rec], pool, G, 1)
    # iterations 1-2: 4 generation tasks (6 round trips each) + 4 train tasks (4 each) in
    # 2 workers x 3.2 s of measured window; 3 + 2 loop cycles per pair of tasks
    assert d["worker_redis_round_trips_per_s"] == pytest.approx(40 / 6.4, abs=0.01)
    assert d["worker_redis_round_trips_per_cycle"] == pytest.approx(2.0)
    plain = summarize(
        "disaggregated",
        [RunRecord("d", 0, Path("d"), rec.metrics, disaggregated_timeline(), False)],
        pool,
        G,
        1,
    )
    assert (
        plain["worker_redis_round_trips_per_s"] is None
        and plain["worker_redis_round_trips_per_cycle"] is None
    )


def test_eval_table_reports_timeline_cost_and_the_ratio_to_the_eval_less_twin():
    from digen.bench import eval_table

    row = {
        "mode": "digen+eval",
        "evaluations": 3,
        "eval_worker_s": 6.0,
        "eval_in_bubbles_s": 5.0,
        "eval_outside_bubbles_s": 1.0,
        "eval_wait_s": 0.5,
        "eval_max_wait_s": 0.25,
        "eval_max_task_s": 0.75,
        "eval_overtakes": 0.0,
        "s_per_iteration": 3.0,
    }
    lines = eval_table([row, {"mode": "digen-eval", "evaluations": 0, "s_per_iteration": 2.0}])
    assert lines[-1] == "| digen+eval | 3 | 6.00 | 5.00 | 1.00 | 0.50 | 0.25 / 0.75 | 0 | 3.000 | 1.50x |"
    assert eval_table([{"mode": "digen", "evaluations": 0}]) == []


def test_startup_summary_keeps_the_breakdown_of_the_largest_peak():
    from digen.bench import startup_summary

    def prof(pss: float, first: float) -> dict:
        rows = [{"process": "controller", "pid": 1, "rss_mb": pss, "pss_mb": pss, "uss_mb": pss}]
        return {
            "phases": [{"phase": "cluster start", "start_s": 1.0, "end_s": 1.0 + first, "duration_s": first}],
            "first_task_s": first,
            "first_iteration_s": 2 * first,
            "peak_tree_rss_mb": pss + 10,
            "peak_tree_pss_mb": pss,
            "peak_tree_processes": rows,
        }

    out = startup_summary([prof(500.0, 3.0), prof(700.0, 5.0), prof(600.0, 4.0)])
    assert out["peak_tree_pss_mb"] == 700.0
    assert out["peak_tree_processes"][0]["pss_mb"] == 700.0
    assert (out["first_task_s"], out["phase_s"]["cluster start"]) == (4.0, 4.0)
    assert startup_summary([])["peak_tree_processes"] == []
