"""Tests' own processes: ``digen`` console-script subprocesses (each killed by its own pid),
their environment under a private ``DIGEN_HOME``, waiting with a bound, and the session's
``DIGEN_HOME`` whose embedded Redis the test process owns (:func:`digen_home`, a fixture a
folder's conftest imports). Shared by the folders whose tests start digen processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DIGEN = str(Path(sys.executable).parent / "digen")  # the console script of this environment


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


@pytest.fixture(scope="session")
def digen_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A private DIGEN_HOME (never ~/.local/share) whose embedded Redis this test process
    starts and owns for the session; subprocesses find it running."""
    from digen.controlplane.redis_conn import connect, start_embedded, stop_embedded

    home = tmp_path_factory.mktemp("digen-home")
    old = os.environ.get("DIGEN_HOME")
    os.environ["DIGEN_HOME"] = str(home)
    client = connect(None, db_path=home / "digen.db")
    yield home
    client.close()
    start_embedded(home / "digen.db").owned = True  # in-process CLI calls shared it; this process stops it
    stop_embedded(home / "digen.db")
    if old is None:
        os.environ.pop("DIGEN_HOME", None)
    else:
        os.environ["DIGEN_HOME"] = old
