"""Calibration round trip: a run directory written from a known cost model gives that cost
model back, and its prediction matches the measurement."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from digen.core.events import Role
from digen.sim.calibrate import compare_run, costmodel_from_run, predict_modes
from digen.sim.costmodel import CostModel, SimWorker, WorkerCost
from digen.sim.dataplane import DataPlaneSeconds
from digen.sim.driver import MODES, simulate
from digen.sim.measure import BUSY_KINDS


def source_model() -> CostModel:
    wc = WorkerCost(
        gen_s=1.0,
        decode_s=0.2,
        reward_s=0.1,
        train_s=1.5,
        train_tsp_s=1.5,
        gen_on_trainer_s=1.0,
        load_s=0.02,
        overhead_s=0.05,
    )
    workers = [SimWorker(n, "cpu", 1, wc) for n in ("rollout-0", "rollout-1", "trainer-0", "trainer-1")]
    return CostModel(
        workers, tasks=4, samples_per_task=4, dataplane=DataPlaneSeconds(reduce_s=0.06, step_s=0.04)
    )


def write_run(root: Path, cost: CostModel, iterations: int = 5) -> None:
    """A run directory as ``digen train`` writes it, from a simulated run."""
    roles = {w.name: Role.ROLLOUT if w.name.startswith("rollout") else Role.TRAINER for w in cost.workers}
    res = simulate(cost, MODES["digen"], roles, iterations=iterations, warmup=1)
    root.mkdir()
    keys = ("worker", "gpu_type", "role", "kind", "iteration", "version", "start", "end")
    (root / "timeline.jsonl").write_text(
        "".join(json.dumps({k: r[k] for k in (*keys, "part") if k in r}) + "\n" for r in res.rows)
    )
    metrics, lo = [], 0.0
    for k, hi in enumerate(res.step_ends):
        busy = sum(
            max(0.0, min(r["end"], hi) - max(r["start"], lo))
            for r in res.rows
            if r["kind"] in BUSY_KINDS and r["worker"] != "controller"
        )
        n = len(cost.workers)
        metrics.append(
            {
                "iteration": k,
                "samples": cost.samples,
                "wall_s": hi - lo,
                "busy_s": busy,
                "worker_s": n * (hi - lo),
                "bubble_ratio": 1 - busy / (n * (hi - lo)),
            }
        )
        lo = hi
    (root / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    cfg = {
        "rollout": {"batch_size": cost.samples, "group_size": cost.samples_per_task},
        "schedule": {"mode": "digen", "gap": True, "tsp": True, "tag": True, "max_staleness": 1},
        "train": {"groups_per_task": cost.groups_per_task},
    }
    (root / "config.yaml").write_text(yaml.safe_dump(cfg))


def test_costmodel_from_run_recovers_the_task_costs(tmp_path):
    write_run(tmp_path / "run", source_model())
    cm = costmodel_from_run(tmp_path / "run")
    assert cm.tasks == 4 and cm.samples_per_task == 4
    by = {w.name: w.cost for w in cm.workers}
    assert by["rollout-0"].gen_s == pytest.approx(1.0)
    assert by["rollout-1"].decode_s == pytest.approx(0.2)
    assert by["trainer-0"].train_s == pytest.approx(1.5)
    assert by["trainer-1"].gen_s == pytest.approx(1.0)  # never generated: its GPU type's mean
    assert by["rollout-0"].overhead_s == pytest.approx(0.05)
    assert by["trainer-0"].load_s == pytest.approx(0.02)
    assert cm.dataplane.reduce_s == pytest.approx(0.06) and cm.dataplane.step_s == pytest.approx(0.04)


def test_prediction_matches_the_run_it_was_calibrated_on(tmp_path):
    write_run(tmp_path / "run", source_model())
    c = compare_run(tmp_path / "run")
    assert c.mode == "digen"
    assert c.samples_per_s_error == pytest.approx(0.0, abs=0.02)
    assert c.predicted_bubble_ratio == pytest.approx(c.measured_bubble_ratio, abs=0.02)
    others = predict_modes(tmp_path / "run", ["colocated-digen", "disaggregated"])
    assert [o.measured_samples_per_s for o in others] == [None, None]
    assert others[1].predicted_samples_per_s < c.predicted_samples_per_s  # synchronous is slower


def test_a_slower_run_is_predicted_slower(tmp_path):
    from dataclasses import replace

    fast, slow = source_model(), source_model()
    slow.workers = [replace(w, cost=replace(w.cost, train_s=3.0, train_tsp_s=3.0)) for w in slow.workers]
    write_run(tmp_path / "fast", fast)
    write_run(tmp_path / "slow", slow)
    assert (
        compare_run(tmp_path / "slow").predicted_samples_per_s
        < compare_run(tmp_path / "fast").predicted_samples_per_s
    )


def test_a_runs_step_is_its_members_optim_rows_and_the_serving_after_them():
    from digen.sim.calibrate import step_seconds

    def row(worker, kind, start, end, **kw):
        return {"worker": worker, "kind": kind, "iteration": 1, "start": start, "end": end, **kw}

    rows = [  # since the data plane: each member's optim row says its reduction, then it serves
        row("trainer-0", "optim", 10.0, 10.5, reduce_s=0.3, step_s=0.2),
        row("trainer-0", "sync", 10.5, 10.6),
        row("trainer-1", "optim", 10.0, 10.4, reduce_s=0.3, step_s=0.1),
        row("trainer-1", "sync", 12.0, 12.2),  # a later weights load, not the step's
    ]
    s = step_seconds(rows)
    assert s.reduce_s == pytest.approx(0.3) and s.step_s == pytest.approx(0.3)  # the longest member
    before = [row("controller", "optim", 5.0, 5.4), row("controller", "sync", 5.4, 5.5)]  # the old broadcast
    assert step_seconds(before).step_s == pytest.approx(0.5) and step_seconds(before).reduce_s == 0.0


def test_a_run_with_several_groups_per_train_task_is_calibrated_per_group(tmp_path):
    """A train row of a ``train.groups_per_task: 2`` run holds two groups' training: the
    calibrated model takes half of it per group, batches as the run did, and predicts the run."""
    from dataclasses import replace

    src = replace(source_model(), groups_per_task=2)
    write_run(tmp_path / "run", src)
    cm = costmodel_from_run(tmp_path / "run")
    assert cm.groups_per_task == 2
    assert {w.name: w.cost for w in cm.workers}["trainer-0"].train_s == pytest.approx(1.5)
    assert compare_run(tmp_path / "run").samples_per_s_error == pytest.approx(0.0, abs=0.02)
