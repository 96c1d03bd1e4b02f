"""digen.startup: phases, worker notes, the process tree's memory."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from digen import startup


def test_phase_records_only_into_an_active_profile():
    with startup.phase("redis start"):
        pass  # no profile: nothing to record into, nothing raised
    prof = startup.StartupProfile(t0=100.0)
    with startup.profiling(prof):
        with startup.phase("redis start"):
            pass
        startup.add_worker_notes(
            {"w1": {"process": 101.0, "load_start": 102.0, "load_end": 104.5, "loop": 105.0, "ready": 105.1}}
        )
    with startup.phase("cluster start"):  # the profile is no longer active
        pass
    names = [(p.name, p.worker) for p in prof.phases]
    assert names == [("redis start", None), ("worker process start", "w1"), ("worker model load", "w1")]
    load = prof.phases[2]
    assert (load.start, load.end) == (102.0, 104.5)
    assert prof.phases[1].end == 102.0  # the model load began before the loop (a preload)


def test_first_task_and_iteration_come_from_the_timeline():
    prof = startup.StartupProfile(t0=10.0)
    prof.add("cluster start", 11.0, 13.0)
    timeline = [
        {"worker": "controller", "kind": "optim", "iteration": 0, "start": 11.5, "end": 20.0},
        {"worker": "rollout-0", "kind": "gen", "iteration": 0, "start": 14.0, "end": 16.0},
        {"worker": "trainer-0", "kind": "train", "iteration": 0, "start": 16.0, "end": 18.0},
        {"worker": "rollout-0", "kind": "gen", "iteration": 1, "start": 20.0, "end": 22.0},
    ]
    out = prof.to_json(timeline, peak_tree_mb=512.0, peak_tree_pss_mb=300.0)
    assert out["first_task_s"] == 4.0  # the controller's row is not a task
    assert out["first_iteration_s"] == 10.0
    assert [p["phase"] for p in out["phases"]] == ["first task", "first iteration", "cluster start"]
    assert out["phases"][2] == {"phase": "cluster start", "start_s": 1.0, "end_s": 3.0, "duration_s": 2.0}
    assert (out["peak_tree_rss_mb"], out["peak_tree_pss_mb"]) == (512.0, 300.0)
    assert "peak memory of the process tree: RSS 512 MiB, PSS 300 MiB" in startup.format_profile(out)


@pytest.mark.slow
def test_tree_memory_counts_the_children():
    """A child holding 200 MiB raises the tree's sum by about that much (RSS and PSS)."""
    import os

    code = "import sys; b = bytearray(200 * 2**20); b[::4096] = b'x' * len(b[::4096]); print('ok', flush=True); sys.stdin.read()"
    before_rss, before_pss = (
        startup.tree_memory_mb(os.getpid()),
        startup.tree_memory_mb(os.getpid(), pss=True),
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "ok"  # the memory is touched by now
        with startup.TreeMemorySampler(period_s=0.05) as mem:
            pass
        assert mem.samples >= 2
        assert mem.peak_mb - before_rss > 190
        assert mem.peak_pss_mb - before_pss > 190
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    assert startup.tree_memory_mb(child.pid) == 0.0  # gone


def test_process_start_time_is_this_processes_creation():
    assert startup.process_start_time() <= time.time()


@pytest.mark.slow
def test_peak_breakdown_names_each_process_of_the_tree():
    """The breakdown at the peak has one row per process: the root as the controller, a
    child by the name given to it, and a tracked outside process by its label."""
    import os

    code = "import sys; print('ok', flush=True); sys.stdin.read()"
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    outside = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "ok"
        assert outside.stdout.readline().strip() == "ok"
        startup.track_process(outside.pid, "redis-server")
        with startup.TreeMemorySampler(period_s=0.05) as mem:
            mem.name(child.pid, "rollout-0")
        rows = {r["pid"]: r for r in mem.peak_breakdown()}
        assert rows[os.getpid()]["process"] == "controller"
        assert rows[child.pid]["process"] == "other rollout-0"
        assert rows[outside.pid]["process"] == "redis-server"
        assert abs(sum(r["pss_mb"] for r in rows.values()) - mem.peak_pss_mb) < 1.0
        lines = startup.format_profile(
            {
                "phases": [],
                "peak_tree_rss_mb": 1.0,
                "peak_tree_pss_mb": 1.0,
                "peak_tree_processes": mem.peak_breakdown(),
            }
        )
        assert any(line.startswith("redis-server") for line in lines)
    finally:
        for p in (child, outside):
            p.stdin.close()
            p.wait(timeout=30)
        startup._TRACKED.pop(outside.pid, None)
