"""A job runner (``digen serve``) killed with SIGKILL mid-job: another runner, idle or started
with ``--burst`` (the README's command), re-runs the job from its checkpoint as soon as the
job is confirmed lost (its heartbeat gone for CONFIRM_S on the Redis clock), not after rq's
90 s + 405 s; the dead attempt's Redis keys are deleted when the retry starts; every
iteration appears once. Real embedded Redis, real rq, real ``digen serve`` subprocesses.

Each test decides from the job's state and log (who re-queued it, which attempt ran where),
and prints the measured times of the state transitions; the waits are guards against a hang."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from digen.cli.main import app
from digen.service import jobs
from digen.service.runner import CONFIRM_S, RECOVERY_BOUND_S, recover_lost_jobs
from tests.processes import Procs, digen_home, wait_for  # noqa: F401 - digen_home: a fixture
from tests.service.conftest import procs, r, reference_run  # noqa: F401 - fixtures
from tests.service.helpers import CONFIG, ITERATIONS, learning_rows, quick_sets

pytestmark = pytest.mark.slow


def cli(*args: object):
    return CliRunner().invoke(app, [str(a) for a in args])


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def log_times(client, job_id: str) -> list[tuple[float, str]]:
    """The job's log lines with their timestamps (seconds, this host's clock)."""
    out = []
    for line in jobs.read_log(client, job_id)[0]:
        stamp, text = line[:19], line[20:]
        out.append((time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")), text))
    return out


def kill_runner_mid_job(client, job_id: str, serve) -> float:
    """SIGKILL ``serve`` once the job has two checkpoints; returns when (this host's clock)."""
    wait_for(lambda: jobs.job_info(client, job_id).iteration >= 2, 240, "two iterations")
    horse = int(jobs._fetch(client, job_id).meta["pid"])
    killed = time.time()
    serve.send_signal(signal.SIGKILL)
    serve.wait(timeout=30)
    wait_for(lambda: not pid_alive(horse), 120, "the work horse to die with serve")
    return killed


def test_the_bound_is_under_two_minutes():
    assert RECOVERY_BOUND_S <= 120


def test_an_idle_runner_reruns_the_job_of_a_killed_one(
    r,  # noqa: F811
    procs: Procs,  # noqa: F811
    tiny_sd3: Path,
    reference_run: Path,  # noqa: F811
    tmp_path: Path,
):
    """serve-1 runs the job, serve-2 waits idle (blocked on the empty queue); serve-1 is killed:
    serve-2's maintenance re-queues the job and runs it (attempt 2), resuming from the
    checkpoint."""
    run = tmp_path / "run"
    res = cli("submit", CONFIG, *quick_sets(tiny_sd3), "--out", run)
    assert res.exit_code == 0, res.output
    job_id = res.stdout.strip()
    serve1 = procs.digen("serve", "--name", "serve-1", name="serve-1")
    wait_for(lambda: jobs.job_info(r, job_id).state == "running", 120, "serve-1 to take the job")
    serve2 = procs.digen("serve", "--name", "serve-2", name="serve-2")  # idle: the queue is empty
    wait_for(lambda: r.exists("rq:worker:serve-2"), 120, "serve-2 to register")
    killed = kill_runner_mid_job(r, job_id, serve1)

    wait_for(lambda: jobs.job_info(r, job_id).state == "done", 300, "serve-2 to re-run the job")
    info = jobs.job_info(r, job_id)
    assert (info.attempts, info.worker, info.iteration) == (2, "serve-2", ITERATIONS)
    lines = log_times(r, job_id)
    requeued = [
        t for t, text in lines if text.startswith("lost: its runner serve-1") and "by serve-2" in text
    ]
    resumed = [t for t, text in lines if text.startswith("resuming after iteration") and "serve-2" in text]
    assert requeued and resumed, lines  # digen's recovery re-queued it, not rq's 90 s cleanup
    print(
        f"\nkilled runner: re-queued {requeued[0] - killed:.0f} s and running again "
        f"{resumed[0] - killed:.0f} s after the SIGKILL (bound {RECOVERY_BOUND_S:g} s)"
    )
    assert learning_rows(run) == learning_rows(reference_run)  # every iteration once, same numbers
    serve2.send_signal(signal.SIGTERM)
    serve2.wait(timeout=60)


def test_serve_burst_reruns_a_lost_job_and_drops_the_dead_attempts_keys(
    r,  # noqa: F811
    procs: Procs,  # noqa: F811
    tiny_sd3: Path,
    tmp_path: Path,
):
    """The README's ``digen serve --burst`` after the runner of a disaggregated job was killed:
    the job is confirmed lost on the Redis clock (CONFIRM_S), re-queued, run again from its
    checkpoint; the dead attempt's controller keys (weights included) are gone once the retry
    runs, and none are left at the end."""
    run = tmp_path / "run"
    sets = [*quick_sets(tiny_sd3, 6), "--set", "schedule.mode=disaggregated"]
    res = cli("submit", CONFIG, *sets, "--out", run)
    assert res.exit_code == 0, res.output
    job_id = res.stdout.strip()
    serve1 = procs.digen("serve", "--name", "serve-1", name="serve-1")
    killed = kill_runner_mid_job(r, job_id, serve1)
    assert r.keys(f"digen:{job_id}.1:*")  # the dead attempt's controller keys
    wait_for(lambda: jobs.job_info(r, job_id).state == "lost", 60, "the job to show as lost")

    # the confirmation window, on a clock the test controls (the Redis server's)
    sec, usec = r.time()
    now = sec + usec / 1e6
    assert [x.action for x in recover_lost_jobs(r, now=now)] == ["waiting"]
    assert [x.action for x in recover_lost_jobs(r, now=now + CONFIRM_S - 1)] == ["waiting"]
    assert jobs.job_info(r, job_id).state == "lost"

    burst = procs.digen("serve", "--burst", "--burst-wait", "1", "--name", "serve-2", name="serve-2")
    wait_for(lambda: jobs.job_info(r, job_id).attempts == 2, 240, "the retry to start")
    wait_for(lambda: jobs.job_info(r, job_id).state == "running", 120, "the retry to run")
    assert not r.keys(f"digen:{job_id}.1:*")  # deleted when the retry started
    assert burst.wait(timeout=600) == 0, procs.output(burst)
    info = jobs.job_info(r, job_id)
    assert (info.state, info.attempts, info.worker, info.iteration) == ("done", 2, "serve-2", 6)
    assert not r.keys(f"digen:{job_id}.*")  # no attempt's keys are left
    lines = log_times(r, job_id)
    requeued = [
        t for t, text in lines if text.startswith("lost: its runner serve-1") and "by serve-2" in text
    ]
    assert requeued, lines
    assert any("deleted" in text and "earlier attempt" in text for _, text in lines), lines
    print(f"\n--burst: re-queued {requeued[0] - killed:.0f} s after the SIGKILL")
    rows = learning_rows(run)
    assert [m["iteration"] for m in rows] == list(range(6))  # every iteration exactly once


def test_a_lost_job_without_retries_fails_with_the_reason(
    r,  # noqa: F811
    procs: Procs,  # noqa: F811
    tiny_sd3: Path,
    tmp_path: Path,
):
    """``--retries 0``: the next runner does not re-run the lost job; it fails it, saying why
    and how to continue it."""
    res = cli("submit", CONFIG, *quick_sets(tiny_sd3), "--out", tmp_path / "run", "--retries", "0")
    assert res.exit_code == 0, res.output
    job_id = res.stdout.strip()
    serve1 = procs.digen("serve", "--name", "serve-1", name="serve-1")
    kill_runner_mid_job(r, job_id, serve1)
    burst = procs.digen("serve", "--burst", "--burst-wait", "1", "--name", "serve-2", name="serve-2")
    assert burst.wait(timeout=300) == 0, procs.output(burst)
    info = jobs.job_info(r, job_id)
    assert (info.state, info.attempts) == ("failed", 1)
    assert info.error == (
        f"JobLost: its runner serve-1 (pid {jobs._fetch(r, job_id).meta['pid']} on "
        f"{jobs._fetch(r, job_id).meta['host']}) died and no retry is left; continue it with "
        f"digen submit --resume {job_id}"
    )
