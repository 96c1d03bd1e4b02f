"""Two runs in one folder: a run holds an OS lock (flock) on its run directory while it uses
it; a second ``digen train`` or ``--resume`` into it is refused with exit 2, naming the
holder's pid and host, before anything in the directory changes. The lock dies with its
process (SIGKILL included): a stale lock file is taken over."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from digen.cli.main import app
from digen.rundir import LOCK_NAME, RunDirBusy, RunLock
from tests.conftest import DIGEN, small_config_data
from tests.processes import wait_for
from tests.reliability.reward_servers import RewardServer

ROOT = Path(__file__).resolve().parents[2]
HOLD = (
    "import sys, time; from pathlib import Path; from digen.rundir import RunLock; "
    "RunLock(Path(sys.argv[1])).acquire(); print('held', flush=True); time.sleep(600)"
)


def snapshot(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def hold(folder: Path) -> subprocess.Popen:
    """Another process that takes ``folder``'s lock and keeps it."""
    p = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(folder)],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None and p.stdout.readline().strip() == "held"
    return p


@pytest.mark.slow
def test_a_held_lock_names_its_holder_and_dies_with_it(tmp_path: Path):
    run = tmp_path / "run"
    holder = hold(run)
    try:
        with pytest.raises(RunDirBusy) as err:
            RunLock(run).acquire()
        msg = str(err.value)
        assert f"is in use by pid {holder.pid} on {socket.gethostname()}" in msg and "--out" in msg
        assert err.value.exit_code == 2
        assert RunLock.holder(run) is not None and f"pid {holder.pid}" in RunLock.holder(run)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    assert (run / LOCK_NAME).exists()  # SIGKILL: the file stays, the kernel dropped the lock
    assert RunLock.holder(run) is None
    with RunLock(run), RunLock(run):  # taken over; re-entrant within a process
        assert json.loads((run / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert not (run / LOCK_NAME).exists()  # released: deleted


def write_config(folder: Path, model_dir: Path, **sections) -> Path:
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(small_config_data(model_dir, **sections)))
    return path


@pytest.mark.slow
def test_train_and_resume_into_a_directory_in_use_are_refused(tiny_sd3: Path, tmp_path: Path):
    run = tmp_path / "run"
    cfg = write_config(tmp_path, tiny_sd3, iterations=1)
    res = CliRunner().invoke(app, ["train", str(cfg), "--out", str(run), "--log-format", "quiet"])
    assert res.exit_code == 0, res.output
    holder = hold(run)
    try:
        before = snapshot(run)
        for extra in ([], ["--resume"]):
            res = CliRunner().invoke(
                app, ["train", str(cfg), "--out", str(run), "--log-format", "quiet", *extra]
            )
            lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
            assert res.exit_code == 2 and len(lines) == 1, res.output
            assert f"is in use by pid {holder.pid} on {socket.gethostname()}" in lines[0]
            assert snapshot(run) == before  # nothing changed, not even digen.log
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)


@pytest.mark.slow
def test_two_digen_train_into_one_folder_write_every_iteration_once(tiny_sd3: Path, tmp_path: Path):
    """The real CLI twice, the second (and a ``--resume``) started while the first runs: each
    is refused (exit 2, naming the first's pid); the first writes every iteration once. The
    first run's reward server holds its first score until both were refused."""
    run = tmp_path / "run"
    iterations = 3
    with RewardServer("gate") as server:
        cfg = write_config(
            tmp_path,
            tiny_sd3,
            iterations=iterations,
            reward=[{"name": "http", "kwargs": {"url": server.url}}],
        )
        cmd = [
            *DIGEN,
            "train",
            str(cfg),
            "--out",
            str(run),
            "--log-format",
            "quiet",
        ]
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        first = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        try:
            wait_for(lambda: server.scores > 0, 300, "the first run to score")  # it holds the lock
            second = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
            resume = subprocess.run(
                [*cmd, "--resume"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
            )
            server.gate.set()
            out, _ = first.communicate(timeout=600)
        finally:
            if first.poll() is None:
                first.kill()
    for refused in (second, resume):
        lines = [ln for ln in refused.stderr.splitlines() if ln.strip()]
        assert refused.returncode == 2 and len(lines) == 1, refused.stderr
        assert f"is in use by pid {first.pid} on {socket.gethostname()}" in lines[0]
    assert first.returncode == 0, out
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in rows] == list(range(iterations))
    assert not (run / LOCK_NAME).exists()


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_a_run_directory_is_not_world_readable(tmp_path, umask):
    """A run's directory allows the user and (as the umask says) their group, never others:
    made new, or taken over from a folder that was world-readable (41-L5); never widened."""
    import os
    import stat

    from digen.rundir import RUN_DIR_MODE, private_dir

    old = os.umask(umask)
    try:
        new = private_dir(tmp_path / "runs" / "new")
        existing = tmp_path / "existing"
        existing.mkdir()
        os.chmod(existing, 0o755)
        private_dir(existing)
        narrow = tmp_path / "narrow"
        narrow.mkdir()
        os.chmod(narrow, 0o700)
        private_dir(narrow)
        with RunLock(tmp_path / "locked"):
            lock_mode = stat.S_IMODE((tmp_path / "locked" / LOCK_NAME).stat().st_mode)
            locked = stat.S_IMODE((tmp_path / "locked").stat().st_mode)
    finally:
        os.umask(old)
    for folder in (new, existing):
        assert stat.S_IMODE(folder.stat().st_mode) == RUN_DIR_MODE & ~umask
    assert locked == RUN_DIR_MODE & ~umask and lock_mode & 0o007 == 0
    assert stat.S_IMODE(narrow.stat().st_mode) == 0o700
