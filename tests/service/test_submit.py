"""digen submit / status / logs / cancel against the real embedded Redis, without a runner:
validation, the enqueued rq job (JSON, no pickle), job states, cancel and resume rules."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import zlib
from datetime import UTC
from pathlib import Path

import pytest
from typer.testing import CliRunner

from digen.cli.main import app
from digen.controlplane.redis_conn import embedded_url
from digen.errors import ConfigError
from digen.service import jobs
from tests.processes import DIGEN, ROOT, proc_env

from .helpers import CONFIG, quick_sets


def cli(*args: object):
    return CliRunner().invoke(app, [str(a) for a in args])


def submit_ok(tiny: Path, out: Path, *extra: str) -> str:
    res = cli("submit", CONFIG, *quick_sets(tiny), "--out", out, *extra)
    assert res.exit_code == 0, res.output
    return res.stdout.strip().splitlines()[-1]


def status_json(job_id: str) -> dict:
    res = cli("status", job_id, "--json")
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_bad_config_is_refused_before_anything_is_enqueued(r, tiny_sd3: Path):
    res = cli("submit", CONFIG, *quick_sets(tiny_sd3), "--set", "rollout.group_size=5")
    assert res.exit_code == 2
    assert "rollout.group_size (5) must divide rollout.batch_size (16)" in res.output
    res = cli("submit", CONFIG, *quick_sets(tiny_sd3), "--set", "schedule.nope=1")
    assert res.exit_code == 2 and "schedule.nope" in res.output
    assert jobs.job_queue(r).count == 0
    assert r.zcard(jobs.INDEX_KEY) == 0
    assert not r.keys("rq:job:*")


def test_submit_enqueues_a_json_job_with_a_long_timeout(r, tiny_sd3: Path, tmp_path: Path):
    job_id = submit_ok(tiny_sd3, tmp_path / "run", "--retries", "1")
    raw = r.hgetall(f"rq:job:{job_id}")
    func, _instance, args, kwargs = json.loads(zlib.decompress(raw[b"data"]))  # JSON, never pickle
    assert func == jobs.JOB_FUNC == "digen.service.runner.execute_job"
    assert args == [] and kwargs["resume"] is False
    assert kwargs["out"] == str((tmp_path / "run").resolve())
    assert Path(kwargs["config"]["model"]["path"]).is_absolute()
    assert kwargs["config"]["iterations"] == 8
    assert json.loads(raw[b"meta"])["total"] == 8
    assert int(raw[b"timeout"]) >= 24 * 3600
    assert int(raw[b"retries_left"]) == 1
    assert jobs.job_queue(r).job_ids == [job_id]
    info = status_json(job_id)
    assert (info["state"], info["iteration"], info["total"]) == ("queued", 0, 8)
    assert info["run_dir"] == kwargs["out"] and info["mode"] == "reference"
    table = cli("status")
    assert (
        table.exit_code == 0 and job_id in table.stdout and "queued" in table.stdout and "0/8" in table.stdout
    )


@pytest.mark.parametrize("old", sorted(jobs.OLD_JOB_FUNCS))
def test_a_job_an_older_digen_queued_runs_the_job_function_at_its_new_home(r, old: str):
    from rq.job import Job
    from rq.serializers import JSONSerializer

    from digen.service.runner import adopt_old_name, execute_job

    queued = Job.create(old, kwargs={"out": "run"}, connection=r, serializer=JSONSerializer)
    queued.save()
    job = Job.fetch(queued.id, connection=r, serializer=JSONSerializer)
    assert job.func_name == old
    adopt_old_name(job)
    assert job.func_name == jobs.JOB_FUNC and job.func is execute_job and job.kwargs == {"out": "run"}


def test_default_run_directory_is_named_after_config_and_job(r, tiny_sd3: Path, tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = cli("submit", CONFIG, *quick_sets(tiny_sd3))
    assert res.exit_code == 0, res.output
    job_id = res.stdout.strip()
    assert status_json(job_id)["run_dir"] == str((tmp_path / "runs" / f"tiny-{job_id}").resolve())


def test_a_run_directory_that_holds_a_run_is_refused(r, tiny_sd3: Path, tmp_path: Path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"iteration": 0}) + "\n")
    res = cli("submit", CONFIG, *quick_sets(tiny_sd3), "--out", run)
    assert res.exit_code == 2 and "already holds a run" in res.output and "--resume" in res.output
    assert jobs.job_queue(r).count == 0


def test_cancel_a_queued_job(r, tiny_sd3: Path, tmp_path: Path):
    job_id = submit_ok(tiny_sd3, tmp_path / "run")
    res = cli("cancel", job_id)
    assert res.exit_code == 0 and "cancelled (it was queued)" in res.output
    assert status_json(job_id)["state"] == "cancelled"
    assert jobs.job_queue(r).count == 0
    again = cli("cancel", job_id)
    assert again.exit_code == 2 and "already cancelled" in again.output
    logs = cli("logs", job_id)
    assert logs.exit_code == 0
    assert "submitted: tiny (reference, 8 iterations)" in logs.stdout
    assert "cancelled before it started" in logs.stdout


def _mark_started(r, job_id: str, taken: float, runner_state: str) -> None:
    """What rq does when a worker takes the job, then what the runner writes in meta."""
    from datetime import datetime

    from rq.job import Job, JobStatus
    from rq.serializers import JSONSerializer

    job = Job.fetch(job_id, connection=r, serializer=JSONSerializer)
    job.started_at = datetime.fromtimestamp(taken, UTC)
    job.set_status(JobStatus.STARTED)
    job.save(include_meta=False)
    job.meta.update({"state": runner_state, "started": taken, "iteration": 3})
    job.save_meta()
    jobs.job_queue(r).remove(job_id)


def test_states_of_a_started_job_follow_its_heartbeat_and_lost_jobs_resume(r, tiny_sd3: Path, tmp_path: Path):
    job_id = submit_ok(tiny_sd3, tmp_path / "run")
    _mark_started(r, job_id, time.time(), "queued")
    assert status_json(job_id)["state"] == "starting"  # taken by a worker, the runner not up yet
    _mark_started(r, job_id, time.time() - 120, "queued")
    assert status_json(job_id)["state"] == "lost"  # never came up
    _mark_started(r, job_id, time.time(), "running")
    assert status_json(job_id)["state"] == "lost"  # was running, its heartbeat stopped: the runner died
    r.set(jobs.alive_key(job_id), "{}", px=600_000)  # a heartbeat (its expiry is Redis's)
    assert status_json(job_id)["state"] == "running"

    res = cli("submit", "--resume", job_id)  # a live runner still owns the run directory
    assert res.exit_code == 2 and f"job {job_id} is running" in res.output

    r.delete(jobs.alive_key(job_id))
    res = cli("submit", "--resume", job_id)
    assert res.exit_code == 0, res.output
    new_id = res.stdout.strip()
    assert new_id != job_id
    old, new = jobs.job_info(r, job_id), jobs.job_info(r, new_id)
    assert (old.state, old.resumed_by) == ("resumed", new_id)
    assert (new.state, new.resumed_from, new.run_dir) == ("queued", job_id, old.run_dir)
    _, _, _, kwargs = json.loads(zlib.decompress(r.hget(f"rq:job:{new_id}", "data")))
    assert kwargs["resume"] is True and kwargs["out"] == old.run_dir

    res = cli("submit", "--resume", job_id)
    assert res.exit_code == 2 and f"already resumed as {new_id}" in res.output
    res = cli("submit", CONFIG, "--resume", new_id)
    assert res.exit_code == 2 and "drop CONFIG" in res.output


def test_unknown_jobs_are_bad_input(r):
    for cmd in (
        ("status", "nosuchjob"),
        ("logs", "nosuchjob"),
        ("cancel", "nosuchjob"),
        ("submit", "--resume", "nosuchjob"),
    ):
        res = cli(*cmd)
        assert res.exit_code == 2, cmd
        assert "no job nosuchjob" in res.output


@pytest.mark.slow
def test_unreachable_redis_is_one_line_naming_the_url(tiny_sd3: Path, digen_home: Path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"redis://alice:hunter2hunter2@127.0.0.1:{port}/0"
    res = subprocess.run(
        [DIGEN, "submit", str(CONFIG), *quick_sets(tiny_sd3), "--redis-url", url],
        cwd=ROOT,
        env=proc_env(digen_home),
        capture_output=True,
        text=True,
        timeout=300,  # a guard against a hang only
    )
    assert res.returncode == 1 and res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert f"cannot reach Redis at redis://alice:***@127.0.0.1:{port}/0 (connection refused)" in lines[0]
    assert "hunter2" not in res.stderr
    for cmd in (("status",), ("serve", "--burst"), ("cancel", "abc"), ("logs", "abc")):
        res2 = cli(*cmd, "--redis-url", url)
        assert res2.exit_code == 1 and "cannot reach Redis at" in res2.output, cmd


def test_log_offsets_survive_trimming(r, monkeypatch):
    monkeypatch.setattr(jobs, "LOG_MAX", 4)
    for i in range(10):
        jobs.push_log(r, "j1", f"line {i}")
    lines, nxt = jobs.read_log(r, "j1")
    assert [ln.split(" ", 2)[2] for ln in lines] == ["line 6", "line 7", "line 8", "line 9"] and nxt == 10
    lines, nxt = jobs.read_log(r, "j1", 8)
    assert [ln.split(" ", 2)[2] for ln in lines] == ["line 8", "line 9"] and nxt == 10
    assert jobs.read_log(r, "j1", 10) == ([], 10)


@pytest.mark.parametrize(("text", "seconds"), [("90", 90), ("45m", 2700), ("12h", 43200), ("7d", 604800)])
def test_parse_duration(text: str, seconds: int):
    assert jobs.parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "0", "-3h", "soon", "3w"])
def test_parse_duration_rejects(text: str):
    with pytest.raises(ConfigError, match="--timeout"):
        jobs.parse_duration(text)


def test_paths_that_exist_only_on_the_serve_host_need_no_check_paths(r, tiny_sd3: Path, tmp_path: Path):
    sets = [*quick_sets(tiny_sd3), "--set", "model.path=/models/sd3"]
    res = cli("submit", CONFIG, *sets, "--out", tmp_path / "run")
    assert res.exit_code == 2 and "model.path (/models/sd3) does not exist" in res.output
    assert jobs.job_queue(r).count == 0
    res = cli("submit", CONFIG, *sets, "--out", tmp_path / "run", "--no-check-paths")
    assert res.exit_code == 0, res.output
    _, _, _, kwargs = json.loads(zlib.decompress(r.hget(f"rq:job:{res.stdout.strip()}", "data")))
    assert kwargs["config"]["model"]["path"] == "/models/sd3"  # checked by the runner when the job starts


def test_password_and_acl_user_urls(tiny_sd3: Path, tmp_path: Path):
    """A Redis with requirepass, and an ACL user limited to digen's and rq's keys."""
    from digen.controlplane.redis_conn import connect, start_embedded, stop_embedded

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    db = tmp_path / "secure.db"
    start_embedded(db, password="s3cret-admin-pw", port=port)
    try:
        admin = connect(f"redis://:s3cret-admin-pw@127.0.0.1:{port}/0")
        admin.execute_command(
            "ACL",
            "SETUSER",
            "digen",
            "on",
            ">s3cret-digen-pw",
            "~digen:*",
            "~rq:*",
            "&*",
            "+@all",
            "-flushall",
            "-flushdb",
            "-shutdown",
            "-config",
            "-debug",
        )
        for url in (
            f"redis://:s3cret-admin-pw@127.0.0.1:{port}/0",
            f"redis://digen:s3cret-digen-pw@127.0.0.1:{port}/0",
        ):
            res = cli(
                "submit", CONFIG, *quick_sets(tiny_sd3), "--out", tmp_path / url[8:13], "--redis-url", url
            )
            assert res.exit_code == 0, res.output
            job_id = res.stdout.strip()
            res = cli("status", "--json", "--redis-url", url)
            assert res.exit_code == 0 and job_id in [j["id"] for j in json.loads(res.stdout)]
            assert cli("cancel", job_id, "--redis-url", url).exit_code == 0
        res = cli("status", "--redis-url", f"redis://digen:wrong-pw@127.0.0.1:{port}/0")
        assert res.exit_code == 1 and "authentication failed" in res.output and "wrong-pw" not in res.output
        admin.close()
    finally:
        stop_embedded(db)


NO_RUNNER = "no digen serve is running on this Redis"


def test_submit_warns_when_no_runner_is_up(r, tiny_sd3: Path, tmp_path: Path):
    """One warning line on stderr (the job id alone on stdout) while no ``digen serve`` is up;
    none once a runner is starting (its ``digen:runner:`` key) or registered with rq."""
    from rq import Worker

    res = cli("submit", CONFIG, *quick_sets(tiny_sd3), "--out", tmp_path / "a")
    assert res.exit_code == 0, res.output
    assert NO_RUNNER in res.stderr and res.stdout.strip() == res.stdout.strip().splitlines()[-1]
    assert jobs.live_runners(r) == []

    jobs.mark_runner(r, "serve-starting")
    assert jobs.live_runners(r) == ["serve-starting"]
    res = cli("submit", CONFIG, *quick_sets(tiny_sd3), "--out", tmp_path / "b")
    assert res.exit_code == 0 and NO_RUNNER not in res.stderr, res.output
    r.delete(jobs.RUNNER_PREFIX + "serve-starting")

    worker = Worker([jobs.job_queue(r)], connection=r, name="serve-registered")
    worker.register_birth()
    try:
        assert jobs.live_runners(r) == ["serve-registered"]
        res = cli("submit", CONFIG, *quick_sets(tiny_sd3), "--out", tmp_path / "c")
        assert res.exit_code == 0 and NO_RUNNER not in res.stderr, res.output
    finally:
        worker.register_death()
    assert jobs.live_runners(r) == []


def test_status_shows_elapsed_time_and_eta_and_a_cancel_is_no_error(r, tiny_sd3: Path, tmp_path: Path):
    """A running job resumed at iteration 2 that reached iteration 6 of 10 in 80 s: elapsed 80 s,
    ETA 80 s (4 iterations left at this attempt's 20 s each), in the JSON and the table; a
    cancelled job shows no error (it was digen.errors.JobCancelled)."""
    from rq.job import Job, JobStatus
    from rq.serializers import JSONSerializer

    job_id = submit_ok(tiny_sd3, tmp_path / "run")
    _mark_started(r, job_id, time.time() - 80, "running")
    job = Job.fetch(job_id, connection=r, serializer=JSONSerializer)
    job.meta.update({"iteration": 6, "start_iteration": 2, "total": 10})
    job.save_meta()
    r.set(jobs.alive_key(job_id), "{}", px=600_000)
    info = status_json(job_id)
    assert info["state"] == "running"
    assert 80 <= info["elapsed_s"] < 80 + 60 and info["eta_s"] == pytest.approx(info["elapsed_s"], rel=1e-3)
    row = next(ln for ln in cli("status").stdout.splitlines() if job_id in ln)
    assert "0:01:" in row  # elapsed and ETA as h:mm:ss
    from rq.results import Result

    job.set_status(JobStatus.FAILED)  # what rq records of a job cancelled while it ran
    Result.create_failure(
        job, 600, "Traceback ...\ndigen.errors.JobCancelled: job cancelled during iteration 6"
    )
    job.meta.update({"error": None})
    job.save_meta()
    r.hset(jobs.info_key(job_id), "cancel", "1")
    r.delete(jobs.alive_key(job_id))
    info = status_json(job_id)
    assert info["state"] == "cancelled" and info["error"] is None and info["eta_s"] is None


def test_submit_resume_takes_set_to_raise_a_finished_jobs_iterations(r, tiny_sd3: Path, tmp_path: Path):
    """``digen submit --resume JOB --set iterations=12``: the new job's config and total carry
    the override; a finished job needs one (refused, naming it, without), CONFIG and --out
    are still refused with --resume."""
    from rq.job import Job, JobStatus
    from rq.serializers import JSONSerializer

    job_id = submit_ok(tiny_sd3, tmp_path / "run")
    jobs.job_queue(r).remove(job_id)
    job = Job.fetch(job_id, connection=r, serializer=JSONSerializer)
    job.set_status(JobStatus.FINISHED)
    job.meta.update({"state": "done", "iteration": 8, "total": 8})
    job.save_meta()
    assert status_json(job_id)["state"] == "done"
    res = cli("submit", "--resume", job_id)
    assert (
        res.exit_code == 2
        and "finished all 8 iterations" in res.output
        and "--set iterations=9" in res.output
    )
    res = cli("submit", "--resume", job_id, "--out", tmp_path / "elsewhere")
    assert res.exit_code == 2 and "drop CONFIG and --out" in res.output
    res = cli("submit", "--resume", job_id, "--set", "iterations=12")
    assert res.exit_code == 0, res.output
    new_id = res.stdout.strip()
    _, _, _, kwargs = json.loads(zlib.decompress(r.hget(f"rq:job:{new_id}", "data")))
    assert kwargs["resume"] is True and kwargs["config"]["iterations"] == 12
    assert status_json(new_id)["total"] == 12
    bad = cli("submit", "--resume", new_id, "--set", "iterations=many")
    assert bad.exit_code == 2 and "iterations ('many')" in bad.output


def test_serve_keeps_a_digen_errors_traceback_off_its_console():
    """rq logs a failed job's traceback; for a digen error (a cancel, bad input), already one
    line in digen serve's output and the job's log, it is dropped; any other keeps it."""
    import logging

    from digen.service.runner import OneLineJobErrors

    def record(exc_string: str) -> logging.LogRecord:
        msg = "Worker %s: job %s: exception raised while executing (%s)\n%s"
        return logging.LogRecord(
            "rq.worker", logging.ERROR, __file__, 0, msg, ("w", "j", "f", exc_string), None
        )

    keep = OneLineJobErrors().filter
    assert not keep(
        record("Traceback (most recent call last):\n ...\ndigen.errors.JobCancelled: job j cancelled")
    )
    assert keep(record("Traceback (most recent call last):\n ...\nZeroDivisionError: division by zero"))
    assert keep(logging.LogRecord("rq.worker", logging.WARNING, __file__, 0, "Work horse killed", (), None))


def _routed_address() -> str | None:
    """This machine's address on the interface that routes outwards (nothing is sent), or
    None when it has only loopback."""
    from digen.controlplane.redis_conn import is_loopback

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
        except OSError:
            return None
        host = s.getsockname()[0]
    return None if is_loopback(host) or host == "0.0.0.0" else host


def test_plain_redis_to_another_host_exits_2_in_one_line_unless_insecure(r, tiny_sd3: Path, tmp_path: Path):
    """A plain ``redis://`` to another host, from --redis-url, DIGEN_REDIS_URL (which digen
    train used to ignore) or --redis-url-file, exits 2 in one line before anything connects;
    --insecure warns once and goes on."""
    url = "redis://:hunter2hunter2@10.1.2.3:6379/0"
    said = "--redis-url redis://:***@10.1.2.3:6379/0 is plain TCP to another host"
    runs = [
        CliRunner().invoke(app, ["status", "--redis-url", url]),
        CliRunner().invoke(app, ["train", str(CONFIG), *quick_sets(tiny_sd3)], env={"DIGEN_REDIS_URL": url}),
    ]
    url_file = tmp_path / "redis-url"
    url_file.write_text(url + "\n")
    url_file.chmod(0o600)
    runs.append(
        CliRunner().invoke(
            app, ["submit", str(CONFIG), *quick_sets(tiny_sd3), "--redis-url-file", str(url_file)]
        )
    )
    for res in runs:
        assert res.exit_code == 2, res.output
        assert len(res.output.strip().splitlines()) == 1 and said in res.output, res.output
        assert "hunter2" not in res.output
    assert jobs.job_queue(r).count == 0

    url_file.write_text(embedded_url(r))  # unix://: the embedded one, found from the file
    res = CliRunner().invoke(app, ["status", "--json", "--redis-url-file", str(url_file)])
    assert res.exit_code == 0 and json.loads(res.stdout) == [], res.output
    res = cli("status", "--redis-url", url, "--redis-url-file", url_file)
    assert res.exit_code == 2 and "not both" in res.output

    host = _routed_address()
    if host is None:
        return
    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]  # nothing listens there once closed: refused at once
    res = cli("status", "--redis-url", f"redis://:hunter2hunter2@{host}:{port}/0", "--insecure")
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == 1 and len(lines) == 2, res.output
    assert (
        lines[0].startswith("warning: --insecure: Redis at redis://:***@")
        and "cannot reach Redis" in lines[1]
    )
    assert "hunter2" not in res.output
