"""Workers joining and leaving mid-job, and one-step-bounded staleness, read from the run's
own timeline (not from the code's claims)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from digen.runtime.cluster import add_local_worker, list_workers
from digen.runtime.controller import run_distributed

pytestmark = pytest.mark.slow


def timeline(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "timeline.jsonl").read_text().splitlines()]


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def after_iterations(out: Path, n: int, action, timeout: float = 240) -> threading.Thread:
    """Run ``action()`` in a thread once ``n`` iterations are in metrics.jsonl."""

    def wait():
        deadline = time.time() + timeout
        while time.time() < deadline:
            p = out / "metrics.jsonl"
            if p.exists() and len(p.read_text().splitlines()) >= n:
                action()
                return
            time.sleep(0.05)

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    return t


def wait_for(cond, what: str, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, what
        time.sleep(0.1)


def test_staleness_one_is_bounded_and_never_mixes_versions(small_config, tmp_path):
    cfg = small_config(iterations=4, schedule__mode="digen", schedule__tag=False)
    out = tmp_path / "run"
    summary = run_distributed(cfg, out)
    events = timeline(out)
    gen_versions: dict[tuple[int, str], set[int]] = {}
    for e in events:
        if e["kind"] in ("gen", "decode", "reward"):
            gen_versions.setdefault((e["iteration"], e["worker"]), set()).add(e["version"])
    # iteration i generates with version max(0, i - 1), one version per trajectory
    for (it, _), versions in gen_versions.items():
        assert versions == {max(0, it - 1)}
    for e in events:
        if e["kind"] == "train":
            assert e["version"] == e["iteration"]
    assert summary["max_staleness"] == 1
    assert [m["max_staleness"] for m in metrics(out)] == [0, 1, 1, 1]


def test_worker_joining_mid_job_gets_tasks_from_the_next_iteration(small_config, tmp_path):
    cfg = small_config(
        iterations=6,
        schedule__mode="disaggregated",
        schedule__gap=True,
        cluster__local={"rollout_workers": 1, "trainer_workers": 1},
    )
    out = tmp_path / "run"
    joined = {}
    holder = {}

    def on_start(ctl):
        holder["ctl"] = ctl

    def progress(m):
        if "event" in m:  # the start notice comes before on_start
            return
        ctl = holder["ctl"]
        if m["iteration"] == 1:
            name = add_local_worker(ctl.cluster, "rollout", "cpu")
            joined.update(name=name, after=m["iteration"] + 1)
            wait_for(lambda: name in {w.name for w in list_workers(ctl.client)}, "worker never joined Dask")
        elif m["iteration"] == 2:
            # hold the controller (as a slow iteration would) until the newcomer's loop has
            # loaded the model, so the job cannot end before it can take work
            wait_for(lambda: ctl.job.is_ready(joined["name"]), "worker loop never became ready")

    run_distributed(cfg, out, on_start=on_start, progress=progress)
    assert joined, "the worker was never added"
    newcomer = [e for e in timeline(out) if e["worker"] == joined["name"]]
    assert newcomer, f"{joined['name']} received no task"
    assert min(e["iteration"] for e in newcomer) >= joined["after"]
    assert [m["samples"] for m in metrics(out)] == [8] * 6


def test_worker_killed_mid_job_loses_no_sample(small_config, tmp_path):
    from digen.trainer import run_reference

    cfg = small_config(
        iterations=4,
        schedule__mode="disaggregated",
        schedule__gap=True,
        schedule__lease_s=5.0,
        cluster__local={"rollout_workers": 1, "trainer_workers": 1},
    )
    ref = tmp_path / "ref"
    run_reference(small_config(iterations=4), ref)
    out = tmp_path / "run"
    killed = {}

    def on_start(ctl):
        def kill():
            info = next(w for w in ctl.workers.values() if w.name == "rollout-0")
            pid = ctl.client.run(os.getpid, workers=[info.address])[info.address]
            os.kill(pid, signal.SIGKILL)
            killed["pid"] = pid

        after_iterations(out, 1, kill)

    run_distributed(cfg, out, on_start=on_start)
    assert killed
    got = metrics(out)
    assert [m["iteration"] for m in got] == [0, 1, 2, 3]
    assert [m["samples"] for m in got] == [8] * 4
    want = metrics(ref)
    for g, w in zip(got, want, strict=True):
        assert g["rewards"] == pytest.approx(w["rewards"], abs=1e-6)


def test_tag_idle_trainer_generates_when_generation_is_the_bottleneck(small_config, tmp_path):
    # generation-heavy: 8 sampling steps per sample, 1 trained step per sample
    cfg = small_config(
        iterations=5,
        schedule__mode="digen",
        rollout__num_steps=8,
        train__timesteps={"strategy": "prefix", "fraction": 0.125},
        rollout__batch_size=16,
        cluster__local={"rollout_workers": 1, "trainer_workers": 1},
    )
    out = tmp_path / "run"
    run_distributed(cfg, out)
    events = timeline(out)
    stolen = [e for e in events if e["worker"].startswith("trainer") and e["kind"] == "gen"]
    assert stolen, "the trainer never generated"
    # TAG starts only once speeds are measured (after iteration 0), and only with a budget
    assert min(e["iteration"] for e in stolen) >= 1
    assert [m["samples"] for m in metrics(out)] == [16] * 5


def test_rat_idle_rollout_trains_when_training_is_the_bottleneck(small_config, tmp_path):
    # training-heavy: every one of the 4 sampling steps is trained, one forward + backward
    # per step (no TSP), plus the KL term's reference forward
    cfg = small_config(
        iterations=5,
        schedule__mode="digen",
        schedule__tsp=False,
        rollout__num_steps=4,
        train__timesteps={"strategy": "prefix", "fraction": 1.0},
        train__kl_beta=0.04,
        rollout__batch_size=16,
        cluster__local={"rollout_workers": 1, "trainer_workers": 1},
    )
    out = tmp_path / "run"
    run_distributed(cfg, out)
    events = timeline(out)
    helped = [e for e in events if e["worker"].startswith("rollout") and e["kind"] == "train"]
    assert helped, "the rollout worker never trained"
    # RAT starts only once speeds are measured (after iteration 0); a rollout worker trains
    # the version it generated the next iteration with (staleness 1: iteration k, version k)
    assert min(e["iteration"] for e in helped) >= 1
    assert all(e["version"] == e["iteration"] for e in helped)
    assert all(e.get("share") == 0.5 for e in helped)  # RAT moves half groups
    assert not [e for e in events if e["worker"].startswith("trainer") and e["kind"] == "gen"]
    assert [m["samples"] for m in metrics(out)] == [16] * 5
