"""digen serve running submitted jobs end to end (real embedded Redis, real subprocesses):
the laptop flow matches ``digen train``; a runner that dies (work horse crash -> rq retry,
whole serve killed -> ``submit --resume``) loses and repeats nothing. Cancel: test_cluster.py."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from typer.testing import CliRunner

from digen.cli.main import app
from digen.service import jobs
from tests.processes import Procs, wait_for

from .helpers import CONFIG, ITERATIONS, learning_rows, quick_sets

pytestmark = pytest.mark.slow


def cli(*args: object):
    return CliRunner().invoke(app, [str(a) for a in args])


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_serve_burst_and_submit_wait_on_a_laptop_match_digen_train(
    tiny_sd3: Path, reference_run: Path, tmp_path: Path
):
    """`digen serve --burst & digen submit CONFIG --wait` with nothing running: they share one
    embedded Redis (whichever starts it), the job's metrics equal `digen train`'s, and the last
    process out saves and stops the server."""
    from digen.controlplane.redis_conn import connect, start_embedded, stop_embedded

    home = tmp_path / "home"
    db = home / "digen.db"
    procs = Procs(home, tmp_path)
    run = tmp_path / "run"
    try:
        serve = procs.digen("serve", "--burst", name="serve")
        submit = procs.digen(
            "submit", str(CONFIG), *quick_sets(tiny_sd3), "--out", str(run), "--wait", name="submit"
        )
        assert submit.wait(timeout=240) == 0, procs.output(submit)
        assert serve.wait(timeout=60) == 0, procs.output(serve)
        assert db.exists() and not Path(f"{db}.settings").exists()  # the last one out saved and stopped it
    finally:
        procs.stop_all()
        client = connect(None, db_path=db)  # a new server from the saved database (or a leftover one)
        try:
            listed = jobs.list_jobs(client)
        finally:
            client.close()
            start_embedded(db).owned = True  # started or found here: stop it either way
            stop_embedded(db)
    assert learning_rows(run) == learning_rows(reference_run)
    out = procs.output(submit)
    job_id = out.splitlines()[0].strip()
    assert f"iteration {ITERATIONS}/{ITERATIONS}" in out and f"job {job_id}: done" in out
    said = procs.output(serve)  # one line per job start and outcome on serve's console
    assert f"job {job_id}: starting on" in said and f"job {job_id}: done: {ITERATIONS} iterations" in said
    (info,) = listed
    assert (info.id, info.state, info.iteration, info.total, info.attempts) == (
        job_id,
        "done",
        ITERATIONS,
        ITERATIONS,
        1,
    )
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert info.reward == last["reward_mean"] and info.samples_per_s == last["samples_per_s"]


def test_a_dead_runner_resumes_without_repeating_or_losing_an_iteration(
    r, procs: Procs, tiny_sd3: Path, reference_run: Path, tmp_path: Path
):
    run = tmp_path / "run"
    res = cli("submit", CONFIG, *quick_sets(tiny_sd3), "--out", run)
    assert res.exit_code == 0, res.output
    job_id = res.stdout.strip()
    serve = procs.digen("serve", "--burst", name="serve-1")

    # 1. the work horse crashes after two checkpoints: rq re-runs the job, which resumes
    wait_for(lambda: jobs.job_info(r, job_id).iteration >= 2, 120, "two iterations")
    horse = int(jobs._fetch(r, job_id).meta["pid"])
    os.kill(horse, signal.SIGKILL)
    wait_for(
        lambda: jobs.job_info(r, job_id).attempts == 2 and jobs.job_info(r, job_id).state == "running",
        60,
        "the automatic retry",
    )
    wait_for(lambda: jobs.job_info(r, job_id).iteration >= 5, 120, "five iterations")

    # 2. the whole digen serve dies: its work horse goes with it, the job is lost
    horse = int(jobs._fetch(r, job_id).meta["pid"])
    serve.send_signal(signal.SIGKILL)
    serve.wait(timeout=10)
    wait_for(lambda: not pid_alive(horse), 60, "the work horse to die with serve")
    wait_for(lambda: jobs.job_info(r, job_id).state == "lost", 120, "the job to show as lost")
    assert jobs.job_info(r, job_id).iteration < ITERATIONS

    # 3. digen submit --resume continues it in the same run directory
    res = cli("submit", "--resume", job_id)
    assert res.exit_code == 0, res.output
    new_id = res.stdout.strip()
    # and a job that is bad only where it runs (its model is missing there): fails once, never retried
    res = cli(
        "submit",
        CONFIG,
        *quick_sets(tiny_sd3),
        "--set",
        "model.path=/nonexistent/sd3",
        "--no-check-paths",
        "--out",
        tmp_path / "bad",
    )
    assert res.exit_code == 0, res.output
    bad_id = res.stdout.strip()
    serve2 = procs.digen("serve", "--burst", name="serve-2")
    assert serve2.wait(timeout=240) == 0, procs.output(serve2)
    bad = jobs.job_info(r, bad_id)
    assert (bad.state, bad.attempts, bad.retries_left) == ("failed", 1, 0)
    assert "model.path (/nonexistent/sd3) does not exist" in bad.error
    new = jobs.job_info(r, new_id)
    assert (new.state, new.iteration, new.run_dir) == ("done", ITERATIONS, str(run.resolve()))
    assert jobs.job_info(r, job_id).state == "resumed"
    assert learning_rows(run) == learning_rows(reference_run)  # every iteration exactly once, same numbers
    assert "resuming after iteration" in cli("logs", new_id).stdout
    assert "attempt 2" in cli("logs", job_id).stdout
