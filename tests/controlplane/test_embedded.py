"""The embedded Redis shared by CLI processes: processes starting together get one server, and
only the last one out stops it, after saving."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.processes import ROOT, proc_env, wait_for

CLIENT = """
import sys, time
from pathlib import Path
from digen.controlplane.embedded import connect_service
r = connect_service(None)
print(r.connection_pool.connection_kwargs["path"], r.incr("visits"), flush=True)
stop = Path(sys.argv[1])
deadline = time.monotonic() + 600  # only a guard against a leaked client: the tests release or kill it
while not stop.exists() and time.monotonic() < deadline:
    time.sleep(0.05)
"""


def client(home: Path, stop: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", CLIENT, str(stop)],
        cwd=ROOT,
        env=proc_env(home),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def visits(home: Path) -> int:
    from digen.controlplane.redis_conn import connect, start_embedded, stop_embedded

    r = connect(None, db_path=home / "digen.db")
    try:
        return int(r.get("visits") or 0)
    finally:
        r.close()
        start_embedded(home / "digen.db").owned = True
        stop_embedded(home / "digen.db")


@pytest.mark.slow
def test_processes_starting_together_share_one_server_and_the_last_out_saves_it(tmp_path: Path):
    home, stop = tmp_path / "home", tmp_path / "stop"
    procs = [client(home, stop) for _ in range(3)]  # started at the same moment
    try:
        lines = [p.stdout.readline().split() for p in procs]  # type: ignore[union-attr]
        assert len({socket for socket, _ in lines}) == 1, lines  # one server for all
        assert sorted(int(n) for _, n in lines) == [1, 2, 3]
        stop.touch()
        assert [p.wait(timeout=30) for p in procs] == [0, 0, 0]
    finally:
        for p in procs:
            p.kill()
    assert not Path(f"{home}/digen.db.settings").exists()  # stopped
    assert visits(home) == 3  # saved: a new server reads what they wrote


@pytest.mark.slow
def test_a_process_leaving_does_not_stop_the_server_under_another(tmp_path: Path):
    home = tmp_path / "home"
    holder = client(home, tmp_path / "release")
    try:
        socket = holder.stdout.readline().split()[0]  # type: ignore[union-attr]
        passer = client(home, tmp_path / "nothing")
        (tmp_path / "nothing").touch()
        assert passer.stdout.readline().split() == [socket, "2"]  # type: ignore[union-attr]
        assert passer.wait(timeout=30) == 0
        time.sleep(0.5)
        assert Path(socket).exists()  # still serving the holder
        (tmp_path / "release").touch()
        assert holder.wait(timeout=30) == 0
        wait_for(lambda: not Path(socket).exists(), 60, "the last process out to stop the server")
    finally:
        holder.kill()
    assert visits(home) == 2
