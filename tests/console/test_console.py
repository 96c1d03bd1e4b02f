"""The console of ``digen train``: digen's progress and warnings; Dask's log in RUN_DIR/digen.log."""

from __future__ import annotations

import json
import logging
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from digen.cli.console import ConsoleFormatter, _quiet_dask, open_run_log, setup_logging
from tests.conftest import DIGEN, small_config_data

ROOT = Path(__file__).resolve().parents[2]


def _record(name: str, level: int, msg: str) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, None, None)


def test_console_drops_dask_chatter_and_keeps_digen_warnings():
    assert not _quiet_dask(_record("distributed.scheduler", logging.INFO, "State start"))
    assert not _quiet_dask(_record("distributed.nanny", logging.WARNING, "still alive, killing"))
    assert _quiet_dask(_record("distributed.nanny", logging.ERROR, "failed to start"))
    assert _quiet_dask(_record("digen.runtime.controller", logging.WARNING, "worker left"))


def test_a_workers_heartbeat_failure_leaves_the_console_and_other_errors_stay():
    """A worker's failed heartbeat (the controller closing its scheduler) is a WARNING there,
    without traceback, so a worker's console handler at ERROR drops it; Dask's other ERRORs
    from the same logger pass unchanged."""
    from digen.workers.context import HeartbeatNotice, quiet_worker_heartbeat

    lg = logging.getLogger("distributed.worker")
    shown: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = shown.append  # type: ignore[method-assign]
    lg.addHandler(handler)
    try:
        quiet_worker_heartbeat()
        quiet_worker_heartbeat()
        assert sum(isinstance(f, HeartbeatNotice) for f in lg.filters) == 1
        try:
            raise OSError("Stream is closed")
        except OSError:
            lg.exception(HeartbeatNotice.MESSAGE)
            lg.exception("Compute Failed")
        assert [r.getMessage() for r in shown] == ["Compute Failed"]
        assert shown[0].exc_info is not None
    finally:
        lg.removeHandler(handler)
        lg.filters = [f for f in lg.filters if not isinstance(f, HeartbeatNotice)]


def test_a_dask_error_is_one_line_that_names_the_log(tmp_path: Path):
    log = tmp_path / "digen.log"
    rec = _record("distributed.nanny", logging.ERROR, "Failed to start process\nTraceback ...\n  more")
    line = ConsoleFormatter(verbose=False, log_file=log).format(rec)
    assert "\n" not in line
    assert line.startswith("error from Dask (distributed.nanny): Failed to start process;")
    assert str(log) in line and "--verbose" in line
    verbose = ConsoleFormatter(verbose=True, log_file=log).format(rec)
    assert "Traceback" in verbose  # --verbose prints Dask's record as it is
    ours = ConsoleFormatter(verbose=False, log_file=log).format(_record("digen.x", logging.WARNING, "a\nb"))
    assert ours == "WARNING digen.x: a\nb"


def test_setup_logging_writes_dask_records_to_the_file_only(tmp_path: Path, capfd):
    log = tmp_path / "run" / "digen.log"
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        setup_logging(False, log, dask=True)
        setup_logging(False, log, dask=True)  # a second call replaces the handlers
        logging.getLogger("distributed.scheduler").info("State start")
        assert not log.exists()  # held until the run starts: a failing command writes nothing
        open_run_log()
        logging.getLogger("digen.test").warning("a digen warning")
        for h in root.handlers:
            h.flush()
        err = capfd.readouterr().err
        text = log.read_text()
    finally:
        for h in [h for h in root.handlers if getattr(h, "digen", False)]:
            root.removeHandler(h)
            h.close()
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    assert "distributed" not in err and "a digen warning" in err
    assert text.count("INFO distributed.scheduler: State start") == 1
    assert "WARNING digen.test: a digen warning" in text


@pytest.mark.slow
def test_train_in_digen_mode_prints_no_dask_lines(tmp_path: Path, tiny_sd3: Path):
    """The real CLI in a subprocess (what a terminal shows, worker processes included), on a
    one-iteration digen run with the start-up profile: no Dask line on the console, Dask's
    INFO lines in the run's digen.log, and startup.json with the phases of every worker."""
    cfg = small_config_data(tiny_sd3, iterations=1, schedule__mode="digen")
    cfg["output"] = {"sample_grid_every": 0, "plots": False}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [
        *DIGEN,
        "train",
        str(path),
        "--out",
        str(out),
        "--log-format",
        "json",
    ]
    res = subprocess.run(
        [*cmd, "--profile-startup"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    console = res.stdout + res.stderr
    assert res.returncode == 0, console
    assert "distributed." not in console, console
    log = (out / "digen.log").read_text()
    assert "INFO distributed.scheduler" in log and "INFO distributed.nanny" in log
    lines = [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
    profile = next(x["startup"] for x in lines if "startup" in x)
    assert profile == json.loads((out / "startup.json").read_text())
    phases = {(p["phase"], p.get("worker")) for p in profile["phases"]}
    for want in ("imports", "redis start", "cluster start", "workers ready"):
        assert (want, None) in phases
    for w in ("rollout-0", "trainer-0"):
        assert ("worker process start", w) in phases and ("worker model load", w) in phases
    assert 0 < profile["first_task_s"] < profile["first_iteration_s"]
    assert profile["peak_tree_pss_mb"] > 0 and profile["peak_tree_rss_mb"] >= profile["peak_tree_pss_mb"]
