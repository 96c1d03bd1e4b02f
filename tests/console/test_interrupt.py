"""Ctrl-C on a real ``digen train``: the job stops with one line that names the last
checkpoint and the command that continues it, no traceback, and no process left behind."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import psutil
import pytest
import yaml

from tests.conftest import DIGEN, small_config_data
from tests.processes import ROOT, proc_env, wait_for

pytestmark = pytest.mark.slow


def _session(sid: int) -> list[psutil.Process]:
    """The live processes of session ``sid`` (the ``digen train`` and what it started there)."""
    found = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (OSError, psutil.Error):
            continue
    return found


def test_ctrl_c_stops_the_job_with_one_line_naming_the_checkpoint_and_the_resume_command(
    tiny_sd3: Path, tmp_path: Path
):
    """SIGINT to the process group of ``digen train`` (what a Ctrl-C at the terminal sends: the
    local cluster's workers get it too) once an iteration's row and a checkpoint exist. It
    exits 130 with one line on stderr, ``interrupted; the last checkpoint is ...: continue with
    digen train CONFIG --out RUN --set ... --resume``, naming the newest intact checkpoint, and
    no ``Traceback``/``KeyboardInterrupt`` from the workers; every process of its session ends.
    The controller's log says every worker loop returned on the stop (none waited out); the
    timeout below is a hang guard only (the controller waited 30 s per worker loop)."""
    from digen.rundir import latest_intact_checkpoint

    data = small_config_data(tiny_sd3, iterations=60, schedule={"mode": "digen"})
    data["output"] = {"sample_grid_every": 0, "plots": False, "checkpoint_every": 1}
    cfg, out = tmp_path / "job.yaml", tmp_path / "run"
    cfg.write_text(yaml.safe_dump(data))
    cmd = [*DIGEN, "train", str(cfg), "--out", str(out), "--log-format", "json", "--set", "seed=5"]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env={**proc_env(tmp_path / "home"), "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    try:
        rows, within = 0, []
        assert proc.stdout is not None
        for line in proc.stdout:  # json lines: a metrics row per iteration, announcements
            msg = json.loads(line) if line.startswith("{") else {}
            rows += int("iteration" in msg and "event" not in msg)
            if msg.get("event") == "progress" and rows == 0:
                within.append(msg)  # iteration 0 in progress (samples generated and trained)
            if rows >= 2 and latest_intact_checkpoint(out) is not None:
                break
        assert proc.poll() is None, "digen train ended before the Ctrl-C"
        assert within and within[-1]["generated"] == within[-1]["samples"] == 8, within
        os.killpg(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    ckpt = latest_intact_checkpoint(out)
    assert ckpt is not None
    again = f"digen train {cfg} --out {out} --set seed=5 --resume"
    assert lines == [f"interrupted; the last checkpoint is {ckpt}: continue with {again}"], stderr
    wait_for(lambda: not _session(proc.pid), 60, "every process of the interrupted run to end")
    log = (out / "digen.log").read_text()
    assert lines[0] in log  # the run's log says how it ended, too
    # how it stopped: every worker loop answered the stop (none was left to the INTERRUPT_WAIT_S
    # deadline, as when the workers died of the SIGINT and the controller waited on loops that
    # never answered); the wait is bounded all the same (tests/runtime/test_controller.py)
    stopped = re.findall(r"interrupted: (\d+) of (\d+) worker loops returned, (\d+) still busy", log)
    assert len(stopped) == 1, log
    returned, loops, busy = map(int, stopped[0])
    assert returned == loops == 2 and busy == 0, stopped  # the rollout and the trainer worker
