"""The embedded Redis ends with the process that started it, SIGKILL included, and the next
start never reuses a dead starter's server; a job whose Redis is lost says which checkpoint
is left, or that there is none and what to do (:mod:`digen.controlplane.redis_life`).

The starters are real processes that start the embedded Redis the way digen does
(``connect(None, outage_s=...)`` as ``run_distributed``, ``connect_service`` as the CLI's
service commands) and real ``digen train`` runs; every wait polls for a condition, with a
generous guard."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import redis
import yaml

from tests.conftest import DIGEN
from tests.processes import ROOT, proc_env, wait_for

STARTER = """
import json, sys, time
from digen.controlplane.redis_conn import connect, digen_home, start_embedded
if sys.argv[1] == "service":
    from digen.controlplane.embedded import connect_service
    r = connect_service(None)
else:
    r = connect(None, outage_s=5.0)  # as run_distributed does
server = start_embedded(digen_home() / "digen.db")  # the one just started or found
print(json.dumps({"pid": server.ref.pid, "socket": server.socket_path, "started": server.watchdog is not None}),
      flush=True)
time.sleep(600)  # a guard only: the tests kill it
"""


@pytest.fixture
def cleanup() -> Iterator[list[psutil.Process]]:
    """The processes a test started (starters, redis-servers): whatever a failed test left
    running is killed afterwards (psutil checks that a pid was not reused)."""
    procs: list[psutil.Process] = []
    yield procs
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


def start(
    home: Path, mode: str = "controller", cleanup: list[psutil.Process] | None = None
) -> tuple[subprocess.Popen, dict]:
    """A process that starts (or finds) the embedded Redis of ``home`` and waits; its line.
    Its pid and its server's go to ``cleanup``."""
    home.mkdir(parents=True, exist_ok=True)
    err = home / f"starter-{len(list(home.glob('starter-*')))}.err"  # the watchdog writes there too
    with open(err, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-c", STARTER, mode],
            cwd=ROOT,
            env=proc_env(home),
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    line = proc.stdout.readline() if proc.stdout else ""
    if not line:
        proc.kill()
        proc.wait(timeout=30)
        raise AssertionError(f"the starter printed nothing: {err.read_text()[-3000:]}")
    info = json.loads(line)
    if cleanup is not None:
        cleanup += [psutil.Process(proc.pid), psutil.Process(info["pid"])]
    return proc, info


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    if proc.stdout is not None:
        proc.stdout.close()


def watchdogs(proc: subprocess.Popen) -> list[psutil.Process]:
    return [
        c
        for c in psutil.Process(proc.pid).children()
        if "digen.controlplane.redis_life" in " ".join(c.cmdline())
    ]


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.slow
def test_the_embedded_redis_ends_with_its_sigkilled_starter(tmp_path: Path, cleanup: list[psutil.Process]):
    home = tmp_path / "home"
    proc, server = start(home, cleanup=cleanup)
    assert server["started"] and not gone(server["pid"])
    (watchdog,) = watchdogs(proc)
    kill(proc)
    wait_for(lambda: gone(server["pid"]), 60, "the redis-server of the killed starter to end")
    wait_for(lambda: gone(watchdog.pid), 60, "the watchdog to exit")
    assert not Path(server["socket"]).exists()
    assert not (home / "digen.db.settings").exists() and not (home / "digen.db.owner").exists()
    # the next start (a --resume) starts its own server
    again, second = start(home, cleanup=cleanup)
    try:
        assert second["started"] and second["pid"] != server["pid"]
    finally:
        kill(again)
    wait_for(lambda: gone(second["pid"]), 60, "the second redis-server to end")


@pytest.mark.slow
def test_a_leftover_of_a_dead_starter_is_stopped_not_reused(tmp_path: Path, cleanup: list[psutil.Process]):
    """The starter and its watchdog both SIGKILLed: the server is left running; the next start
    stops it and starts its own."""
    home = tmp_path / "home"
    proc, server = start(home, cleanup=cleanup)
    for watchdog in watchdogs(proc):
        watchdog.kill()
        wait_for(lambda w=watchdog: gone(w.pid), 60, "the watchdog to die")  # a zombie: its parent reaps it
    kill(proc)
    assert not gone(server["pid"])  # a leftover: nothing stopped it
    again, second = start(home, cleanup=cleanup)
    try:
        assert second["started"] and second["pid"] != server["pid"] and second["socket"] != server["socket"]
        wait_for(lambda: gone(server["pid"]), 60, "the leftover redis-server to end")
    finally:
        kill(again)
    wait_for(lambda: gone(second["pid"]), 60, "the second redis-server to end")


@pytest.mark.slow
def test_a_shared_server_outlives_its_killed_starter_until_no_process_uses_it(
    tmp_path: Path, cleanup: list[psutil.Process]
):
    """``connect_service`` (digen serve, submit...): the starter SIGKILLed while another process
    is connected; its watchdog looks (a connection of its own, seen in the server's counters)
    and leaves the server to the other process; once that one is killed too, it stops it."""
    home = tmp_path / "home"
    first, server = start(home, "service", cleanup)
    (watchdog,) = watchdogs(first)
    second, found = start(home, "service", cleanup)
    try:
        assert server["started"] and not found["started"] and found["pid"] == server["pid"]
        probe = redis.Redis(unix_socket_path=server["socket"])
        before = int(probe.info("stats")["total_connections_received"])
        probe.close()
        kill(first)

        mine = [0]

        def looked_twice() -> bool:  # connections received, less this test's own probes
            mine[0] += 1
            probe = redis.Redis(unix_socket_path=server["socket"])
            try:
                return int(probe.info("stats")["total_connections_received"]) - mine[0] >= before + 2
            finally:
                probe.close()

        wait_for(looked_twice, 60, "the watchdog to look at the server")
        assert not gone(server["pid"]) and not gone(watchdog.pid)
    finally:
        kill(second)
    wait_for(lambda: gone(server["pid"]), 60, "the shared redis-server to end once unused")
    wait_for(lambda: gone(watchdog.pid), 60, "the watchdog to exit")
    assert not (home / "digen.db.owner").exists()


def test_a_client_of_an_embedded_server_that_exited_fails_at_once(tmp_path: Path):
    """``connect(None, outage_s=...)`` (the controller): a killed embedded server is not
    waited for (nothing restarts it on its socket); the retry says it exited."""
    from digen.controlplane.redis_conn import connect, start_embedded, stop_embedded

    db = tmp_path / "home" / "digen.db"
    r = connect(None, db_path=db, outage_s=600.0)  # a wait the test would time out on
    try:
        pid = start_embedded(db).ref.pid
        assert pid and r.ping()
        psutil.Process(pid).kill()
        wait_for(lambda: gone(pid), 60, "the embedded redis-server to die")
        with pytest.raises(redis.ConnectionError):
            r.ping()
        assert r.get_retry().exited
    finally:
        stop_embedded(db)


# ---------------------------------------------------------------------------------------------
# the messages


def test_the_advice_names_the_last_checkpoint_or_says_there_is_none(tmp_path: Path):
    from digen.rundir import checkpoint_advice

    run = tmp_path / "run"
    run.mkdir()
    empty = checkpoint_advice(run)
    assert empty.startswith("no checkpoint was written yet") and empty.endswith(
        "rerun without --resume (a fresh run)"
    )
    (run / "metrics.jsonl").write_text(json.dumps({"iteration": 0}) + "\n")
    rows = checkpoint_advice(run, once=" once Redis is back")
    assert "start a fresh run without --resume once Redis is back" in rows
    assert rows.endswith(f"with another --out or after deleting {run}")
    for name in ("iter_0000", "iter_0001", "iter_0002"):
        (run / "checkpoints" / name).mkdir(parents=True)
    for name in ("iter_0000", "iter_0001"):  # iter_0002 was cut before its state.json
        (run / "checkpoints" / name / "state.json").write_text("{}")
    assert (
        checkpoint_advice(run)
        == f"the last checkpoint is {run / 'checkpoints' / 'iter_0001'}: rerun with --resume"
    )


def test_a_run_directory_without_checkpoint_says_what_to_do(tmp_path: Path):
    """``--resume`` with no checkpoint, and a fresh run where a run without checkpoint wrote
    rows: one line each, and neither sends the user to the other."""
    from digen.checks import run_dir_problems
    from digen.errors import ConfigError
    from digen.rundir import RunDir

    run = tmp_path / "run"
    run.mkdir()
    (problem,) = run_dir_problems(run, resume=True)
    assert problem == f"--resume: {run} has no checkpoint yet; start without --resume"
    (run / "metrics.jsonl").write_text(json.dumps({"iteration": 0}) + "\n")
    (problem,) = run_dir_problems(run, resume=True)
    assert "has no checkpoint" in problem and "with another --out or after deleting" in problem
    with pytest.raises(ConfigError) as err:
        RunDir(run, None, resume=False)  # type: ignore[arg-type]  # refused before the config is used
    assert "wrote no checkpoint" in str(err.value) and "pass --resume" not in str(err.value)


def tiny_job(tiny_sd3: Path, tmp_path: Path, **extra) -> Path:
    from tests.conftest import small_config_data

    data = small_config_data(tiny_sd3, schedule={"mode": "digen"}, **extra)
    data["output"] = {"sample_grid_every": 0, "plots": False}
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump(data))
    return cfg


@pytest.mark.slow
def test_embedded_redis_lost_before_any_checkpoint_says_so(tiny_sd3: Path, tmp_path: Path, monkeypatch):
    """The embedded redis-server SIGKILLed once the job runs, before any iteration ends: the
    job fails at once (nothing restarts an embedded server: it does not wait out
    ``redis_outage_s``) with one line that says the server exited, that no checkpoint exists
    and to run afresh; ``--resume`` is then one line, and a fresh run there is not refused."""
    from typer.testing import CliRunner

    from digen.cli.main import app
    from digen.config import load_config
    from digen.controlplane.redis_conn import digen_home, start_embedded, stop_embedded
    from digen.errors import ConnectionFailure
    from digen.rundir import RunDir
    from digen.runtime.controller import run_distributed

    monkeypatch.setenv("DIGEN_HOME", str(tmp_path / "home"))  # a server of its own, killed here
    cfg_path = tiny_job(tiny_sd3, tmp_path, iterations=2)
    cfg = load_config(cfg_path, overrides=["schedule.redis_outage_s=60"])
    out = tmp_path / "run"
    killed: list[int] = []

    def kill_redis_at_start(m: dict) -> None:
        if m.get("event") == "start" and not killed:
            pid = start_embedded(digen_home() / "digen.db").ref.pid
            assert pid
            psutil.Process(pid).kill()
            wait_for(lambda: gone(pid), 60, "the embedded redis-server to die")
            killed.append(pid)

    try:
        with pytest.raises(ConnectionFailure) as err:
            run_distributed(cfg, out, progress=kill_redis_at_start)
    finally:
        stop_embedded(digen_home() / "digen.db")
    msg = str(err.value)
    assert killed and "\n" not in msg and err.value.exit_code == 1
    assert (
        msg.startswith("the embedded Redis at unix://")
        and f"(pid {killed[0]}) exited (ConnectionError)" in msg
    )
    assert msg.endswith(
        "no checkpoint was written yet, nothing to --resume from: rerun without --resume (a fresh run)"
    )
    res = CliRunner().invoke(app, ["train", str(cfg_path), "--out", str(out), "--resume"])
    errors = [ln for ln in res.output.splitlines() if "error" in ln.lower()]
    assert res.exit_code == 2 and len(errors) == 1 and errors[0].startswith("error: "), res.output
    assert "has no checkpoint yet; start without --resume" in errors[0]
    RunDir(out, cfg)  # the fresh run the message advises is not refused


def resumed(cfg: Path, out: Path, home: Path) -> None:
    """``digen train --resume`` two iterations past the newest checkpoint: it starts its own
    embedded Redis (its log says started, never found) and ends with every iteration once."""
    last = max(  # whole checkpoints only: a SIGKILL mid-write leaves a staged iter_NNNN.tmp
        int(p.name.split("_")[1])
        for p in (out / "checkpoints").glob("iter_*")
        if p.name.split("_")[1].isdigit()
    )
    cmd = [*DIGEN, "train", str(cfg), "--out", str(out), "--resume"]
    res = subprocess.run(
        [*cmd, "--set", f"iterations={last + 2}", "--log-format", "quiet"],
        cwd=ROOT,
        env={**proc_env(home), "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    log = (out / "digen.log").read_text()
    assert log.count("embedded Redis started") >= 2 and "embedded Redis found" not in log
    assert "left running by a process that died" not in log  # the watchdog had stopped it
    rows = [json.loads(line)["iteration"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    resumes = [line for line in log.splitlines() if "resum" in line]
    assert rows == list(range(last + 2)), (
        last,
        sorted(p.name for p in (out / "checkpoints").iterdir()),
        resumes,
    )
    assert not (home / "digen.db.owner").exists()  # the resumed run's server ended with it


@pytest.mark.slow
def test_a_sigkilled_digen_train_leaves_no_redis_behind(
    tiny_sd3: Path, tmp_path: Path, cleanup: list[psutil.Process]
):
    """A real ``digen train`` (digen mode, local cluster) SIGKILLed after its first iteration:
    its embedded redis-server ends, and ``--resume`` starts its own and finishes."""
    home, out = tmp_path / "home", tmp_path / "run"
    cfg = tiny_job(tiny_sd3, tmp_path, iterations=50)
    proc = subprocess.Popen(
        [
            *DIGEN,
            "train",
            str(cfg),
            "--out",
            str(out),
            "--log-format",
            "quiet",
        ],
        cwd=ROOT,
        env={**proc_env(home), "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    tree: list[psutil.Process] = []
    try:

        def first_iteration() -> bool:
            path = out / "metrics.jsonl"
            return path.exists() and bool(path.read_text().strip()) or proc.poll() is not None

        wait_for(first_iteration, 600, "the first iteration")
        assert proc.poll() is None, "digen train ended before it was killed"
        owner = json.loads((home / "digen.db.owner").read_text())
        settings = json.loads((home / "digen.db.settings").read_text())
        redis_pid = int(Path(settings["pidfile"]).read_text())
        cleanup.append(psutil.Process(redis_pid))
        assert owner["pid"] == proc.pid and not gone(redis_pid)
        tree = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        wait_for(lambda: gone(redis_pid), 60, "the redis-server of the killed digen train to end")
        assert not Path(owner["socket"]).exists()
        resumed(cfg, out, home)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        for child in tree:  # the local cluster's processes, orphaned by the SIGKILL
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(tree, timeout=30)
