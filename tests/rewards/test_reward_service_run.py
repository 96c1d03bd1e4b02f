"""A training run scoring through a real `digen reward-server` process, and what happens when
that server dies mid-run: retries, then a clear error, with the last checkpoint kept."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.request

import pytest

from digen.errors import RewardError
from digen.reference import run_reference
from tests.conftest import DIGEN

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [
            *DIGEN,
            "reward-server",
            "--reward",
            "brightness",
            "--port",
            str(port),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 180  # a guard: importing torch in a new process is slow on a loaded machine
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if json.loads(r.read())["status"] == "ok":
                    return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError("reward server did not start")


def test_server_process_scores_like_the_local_reward_and_its_death_is_reported(small_config, tmp_path):
    port = free_port()
    server = start_server(port)
    try:
        remote = small_config(
            iterations=3,
            reward=[
                {
                    "name": "http",
                    "kwargs": {
                        "url": f"http://127.0.0.1:{port}",
                        "retries": 2,
                        "backoff_s": 0.05,
                        "timeout_s": 5,
                    },
                }
            ],
        )
        local = small_config(iterations=1)
        run_reference(local, tmp_path / "local")

        def kill_after_first(m):
            if "event" not in m and m["iteration"] == 1:
                server.kill()
                server.wait()

        with pytest.raises(RewardError, match=f"127.0.0.1:{port}.*unreachable"):
            run_reference(remote, tmp_path / "remote", progress=kill_after_first)
    finally:
        server.kill()
    rows = [json.loads(x) for x in (tmp_path / "remote/metrics.jsonl").read_text().splitlines()]
    ref = [json.loads(x) for x in (tmp_path / "local/metrics.jsonl").read_text().splitlines()]
    # PNG transport quantises images to 8 bits: scores agree to ~1/255
    assert rows[0]["rewards"] == pytest.approx(ref[0]["rewards"], abs=2 / 255)
    assert [r["iteration"] for r in rows] == [0, 1]
    assert (tmp_path / "remote/checkpoints/iter_0001/weights.safetensors").exists()
