"""Redis restarted without persistence mid-job loses the job's data: the job stops with one
line that names the cause ("Redis lost the job's data (restarted without persistence); rerun
with --resume"), not a poison task, and --resume (Redis back) finishes it, every iteration once."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import redis

from digen.errors import ConnectionFailure
from tests.reliability.conftest import fault_config, metrics, run_job
from tests.reliability.test_redis_restart import REDIS_SERVER, free_port

pytestmark = pytest.mark.slow


class VolatileRedis:
    """A redis-server with no persistence at all (no AOF, no RDB)."""

    def __init__(self, folder: Path, port: int):
        import subprocess

        self.folder, self.port, self.subprocess = folder, port, subprocess
        self.proc = None

    def start(self) -> None:
        self.proc = self.subprocess.Popen(
            [
                str(REDIS_SERVER),
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.folder),
                "--appendonly",
                "no",
                "--save",
                "",
            ],
            stdout=self.subprocess.DEVNULL,
            stderr=self.subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 20
        while True:
            try:
                if client.ping():
                    return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=20)


def test_redis_that_lost_the_jobs_data_is_named_and_resume_finishes(tiny_sd3: Path, tmp_path: Path):
    server = VolatileRedis(tmp_path, free_port())
    server.start()
    url = f"redis://127.0.0.1:{server.port}/0"
    cfg = fault_config(
        tiny_sd3,
        schedule={"mode": "disaggregated", "gap": True, "max_staleness": 0, "redis_outage_s": 60.0},
        cluster__local={"rollout_workers": 1, "trainer_workers": 1},
    )
    out = tmp_path / "run"
    done: list[int] = []

    def restart_empty() -> None:
        server.kill()
        time.sleep(1.0)  # the clients notice; the job's keys are gone with the process
        server.start()

    def after_first_iteration(m: dict) -> None:
        if "event" in m or done:
            return
        done.append(len(metrics(out)))
        threading.Thread(target=restart_empty, daemon=True).start()

    try:
        with pytest.raises(ConnectionFailure) as err:
            run_job(cfg, out, "redis-lost", redis_url=url, progress=after_first_iteration)
        msg = str(err.value)
        assert "\n" not in msg and err.value.exit_code == 1
        assert msg.startswith("Redis lost the job's data (restarted without persistence)")
        assert msg.endswith("rerun with --resume") and "poison" not in msg
        from digen.runtime.controller import run_distributed

        run_distributed(cfg, out, resume=True, redis_url=url, job_id="redis-lost-2")
    finally:
        server.kill()
    assert [m["iteration"] for m in metrics(out)] == [0, 1, 2]
