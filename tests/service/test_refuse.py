"""``digen serve`` runs digen's job alone: rq jobs that anyone holding the Redis password
could queue (another function, a pickled payload, a callback) are refused before anything
they name is imported or called, recorded failed with one line, and counted in
``digen status``. Against the real embedded Redis, with the real runner (its work horse
forked by rq)."""

from __future__ import annotations

import json
import pickle
import zlib
from pathlib import Path

import pytest
from rq import Callback
from rq.job import Job
from rq.serializers import JSONSerializer
from typer.testing import CliRunner

from digen.cli.main import app
from digen.controlplane.redis_conn import embedded_url
from digen.service import jobs, runner


def _serve_burst(r) -> None:
    assert runner.serve(r, embedded_url(r), burst=True, burst_wait_s=5, name="serve-refuse") is True


def _enqueue_raw(r, job: Job) -> None:
    job.save()
    jobs.job_queue(r).push_job_id(job.id)


def _status(*args: str):
    res = CliRunner().invoke(app, ["status", *args])
    assert res.exit_code == 0, res.output
    return res


def test_an_rq_job_naming_os_system_is_refused_never_run_and_counted(r, tmp_path: Path):
    marker = tmp_path / "ran"
    job = jobs.job_queue(r).enqueue_call("os.system", args=(f"touch {marker}",), job_id="evil-system")
    assert json.loads(zlib.decompress(r.hget("rq:job:evil-system", "data")))[0] == "os.system"

    _serve_burst(r)

    assert not marker.exists()
    job = Job.fetch("evil-system", connection=r, serializer=JSONSerializer)
    assert job.get_status() == "failed" and job.retries_left == 0
    info = jobs.job_info(r, "evil-system")
    assert info.state == "failed"
    assert info.error == (
        "refused rq job evil-system: it names os.system, not digen's job "
        "digen.service.runner.execute_job; not imported, not called"
    )
    assert jobs.refused(r) == (1, info.error)
    assert any(line.endswith(info.error) for line in jobs.read_log(r, "evil-system")[0])
    table = _status().stdout
    assert "evil-system" in table and "failed" in table
    assert f"1 rq job refused (not digen's job); newest: {info.error}" in " ".join(table.split())
    assert [j["id"] for j in json.loads(_status("--json").stdout)] == ["evil-system"]
    res = CliRunner().invoke(app, ["submit", "--resume", "evil-system"])
    assert res.exit_code == 2 and "was refused (not digen's job" in res.output, res.output


def _pickled(r, tmp_path: Path) -> Job:
    """A job queued by rq's default (pickle) serializer: digen's JSON never parses it."""
    return Job.create("os.system", args=(f"touch {tmp_path / 'ran'}",), connection=r, id="evil-pickle")


def _callback(r, tmp_path: Path) -> Job:
    """digen's own function, with an rq failure callback that would run a command."""
    return Job.create(
        jobs.JOB_FUNC,
        kwargs={"config": {}, "out": str(tmp_path / "run")},
        connection=r,
        serializer=JSONSerializer,
        id="evil-callback",
        on_failure=Callback("os.system"),
        on_success=Callback("os.system"),
    )


def _method(r, tmp_path: Path) -> Job:
    """A method of a JSON value (rq's ``instance``) instead of a function."""
    job = Job.create(jobs.JOB_FUNC, kwargs={}, connection=r, serializer=JSONSerializer, id="evil-method")
    job.data = json.dumps(["format", "{}", [str(tmp_path / "ran")], {}]).encode()
    return job


def _extra_argument(r, tmp_path: Path) -> Job:
    return Job.create(
        jobs.JOB_FUNC,
        kwargs={"config": {}, "out": str(tmp_path / "run"), "hook": "os.system"},
        connection=r,
        serializer=JSONSerializer,
        id="evil-kwarg",
    )


def _positional(r, tmp_path: Path) -> Job:
    return Job.create(
        jobs.JOB_FUNC, args=({}, None, "run"), connection=r, serializer=JSONSerializer, id="evil-args"
    )


def _bad_type(r, tmp_path: Path) -> Job:
    return Job.create(
        jobs.JOB_FUNC,
        kwargs={"config": "os.system", "out": str(tmp_path / "run")},
        connection=r,
        serializer=JSONSerializer,
        id="evil-type",
    )


def _zip_bomb(r, tmp_path: Path) -> Job:
    """A payload of 64 MiB of JSON that rq stores zipped in 64 KiB."""
    job = Job.create(jobs.JOB_FUNC, kwargs={}, connection=r, serializer=JSONSerializer, id="evil-bomb")
    job.data = b'["os.system", null, ["' + b" " * (64 << 20) + b'"], {}]'
    return job


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (_zip_bomb, "its payload unzips to more than digen's 16777216 bytes; not read"),
        (_pickled, "its payload is not JSON (pickled?)"),
        (_callback, "it asks rq to call os.system on success"),
        (_method, "it names a method format of {}, not"),
        (_extra_argument, 'unknown argument(s) ["hook"]'),
        (_positional, "takes no positional argument"),
        (_bad_type, "argument config is str, not dict"),
    ],
)
def test_jobs_that_are_not_digens_are_refused(r, tmp_path: Path, make, says: str):
    job = make(r, tmp_path)
    _enqueue_raw(r, job)
    if make is _pickled:
        assert pickle.loads(zlib.decompress(r.hget(job.key, "data")))[0] == "os.system"

    _serve_burst(r)

    assert not (tmp_path / "ran").exists() and not (tmp_path / "run").exists()
    info = jobs.job_info(r, job.id)
    assert info.state == "failed" and info.error.startswith(f"refused rq job {job.id}: ")
    assert says in info.error, info.error
    assert jobs.refused(r)[0] == 1


def test_digens_own_job_passes_the_check(r, tiny_sd3: Path, tmp_path: Path):
    from digen.config import load_config

    from .helpers import CONFIG

    cfg = load_config(CONFIG, [f"model.path={tiny_sd3}"])
    job_id = jobs.submit(r, cfg, tmp_path / "run")
    job = Job.fetch(job_id, connection=r, serializer=JSONSerializer)
    assert runner.refusal(job) is None
    for old in jobs.OLD_JOB_FUNCS:
        job.func_name = old
        assert runner.refusal(job) is None
