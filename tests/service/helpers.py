"""Helpers of the service tests: the tiny test config's test overrides, subprocesses of the
``digen`` console script (each killed by its own pid), waiting with a bound."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = Path(__file__).with_name("tiny.yaml")  # the tiny workload; tests --set its model path
DIGEN = str(Path(sys.executable).parent / "digen")  # the console script of this environment
ITERATIONS = 8
TIMING = {"wall_s", "samples_per_s", "busy_s", "worker_s", "bubble_ratio"}
# the prompt-embedding cache's counters follow the worker processes, not the learning: a
# resumed job's new workers start with an empty cache (digen.prompt_cache)
PROCESS_COUNTERS = {"embed_cache_hits", "embed_cache_misses", "embed_cache_hit_rate"}


def quick_sets(model_dir: Path, iterations: int = ITERATIONS, *extra: str) -> list[str]:
    """``--set`` overrides of CONFIG for a test run."""
    sets = [f"model.path={model_dir}", f"iterations={iterations}", *extra]
    return [a for s in sets for a in ("--set", s)]


def learning_rows(run_dir: Path) -> list[dict]:
    """``metrics.jsonl`` without the timing columns and the per-process cache counters."""
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line]
    return [{k: v for k, v in r.items() if k not in TIMING | PROCESS_COUNTERS} for r in rows]


def wait_for(pred: Callable[[], object], timeout_s: float, what: str, poll_s: float = 0.2) -> object:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def proc_env(home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "DIGEN_HOME": str(home),
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "HF_HUB_OFFLINE": "1",
        }
    )
    env.pop("DIGEN_REDIS_URL", None)
    env.pop("DIGEN_SCHEDULER", None)
    return env


class Procs:
    """Subprocesses started by one test, each killed (by its own pid) at the end."""

    def __init__(self, home: Path, logs: Path):
        self.home, self.logs = home, logs
        self.started: list[subprocess.Popen] = []

    def start(self, *args: str, name: str) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
        p = subprocess.Popen([*args], cwd=ROOT, env=proc_env(self.home), stdout=log, stderr=subprocess.STDOUT)
        p.log_path = self.logs / f"{name}.log"  # type: ignore[attr-defined]
        self.started.append(p)
        return p

    def digen(self, *args: str, name: str) -> subprocess.Popen:
        return self.start(DIGEN, *args, name=name)

    def run(self, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(
            [DIGEN, *args],
            cwd=ROOT,
            env=proc_env(self.home),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )

    @staticmethod
    def output(p: subprocess.Popen) -> str:
        return Path(p.log_path).read_text()  # type: ignore[attr-defined]

    def stop_all(self) -> None:
        for p in self.started:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        for p in self.started:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover
                pass
