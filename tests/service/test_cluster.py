"""A digen-mode job on an external Dask scheduler with `digen worker` processes of different
GPU types: the job uses both, a third worker started mid-job receives tasks, and `digen
cancel` stops the job mid-iteration with its last checkpoint (`submit --wait` exits 1)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from digen.cli.main import app
from digen.service import jobs
from tests.processes import Procs, wait_for

from .helpers import CONFIG, quick_sets

pytestmark = pytest.mark.slow

DASK = str(Path(sys.executable).parent / "dask")


def cli(*args: object):
    return CliRunner().invoke(app, [str(a) for a in args])


def timeline(run: Path) -> list[dict]:
    path = run / "timeline.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            break
    return rows


def start_scheduler(procs: Procs, tmp_path: Path) -> str:
    info = tmp_path / "scheduler.json"
    procs.start(
        DASK,
        "scheduler",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--no-dashboard",
        "--scheduler-file",
        str(info),
        name="scheduler",
    )
    wait_for(lambda: info.exists() and info.stat().st_size > 0, 60, "the dask scheduler")
    return json.loads(info.read_text())["address"]


def start_worker(procs: Procs, scheduler: str, role: str, gpu: str):
    name = f"{role}-{gpu}"
    p = procs.digen(
        "worker",
        "--scheduler",
        scheduler,
        "--role",
        role,
        "--gpu-type",
        gpu,
        "--name",
        name,
        "--device",
        "cpu",
        name=name,
    )
    wait_for(
        lambda: f"digen worker {name} ({role}, gpu-{gpu}) joined" in procs.output(p), 90, f"{name} to join"
    )
    return p


def test_external_scheduler_gpu_types_and_a_worker_joining_mid_job(
    r, procs: Procs, tiny_sd3: Path, tmp_path: Path
):
    scheduler = start_scheduler(procs, tmp_path)
    start_worker(procs, scheduler, "rollout", "gpua")
    start_worker(procs, scheduler, "trainer", "gpub")
    run = tmp_path / "run"
    submit = procs.digen(
        "submit",
        str(CONFIG),
        *quick_sets(tiny_sd3, 300, "schedule.mode=digen"),
        "--out",
        str(run),
        "--wait",
        name="submit",
    )
    job_id = wait_for(lambda: (procs.output(submit).splitlines() or [""])[0].strip(), 60, "the job id")
    serve = procs.digen("serve", "--scheduler", scheduler, "--burst", name="serve")

    started = wait_for(
        lambda: [ln for ln in jobs.read_log(r, job_id)[0] if "cluster up" in ln],
        180,
        "the job to place its worker loops",
    )
    assert "cluster up: 2 workers: rollout-gpua [rollout], trainer-gpub [trainer]" in started[0]
    start_worker(procs, scheduler, "rollout", "gpuc")  # a new node of another GPU type, mid-job
    joined = wait_for(
        lambda: [e for e in timeline(run) if e["worker"] == "rollout-gpuc" and e["kind"] == "gen"],
        180,
        "the new worker to generate",
    )
    res = cli("cancel", job_id)
    assert res.exit_code == 0 and "cancel requested" in res.output
    assert submit.wait(timeout=120) == 1  # --wait exits with the job's outcome
    assert serve.wait(timeout=120) == 0, procs.output(serve)

    # cancelled mid-iteration: every finished iteration logged once, the last one's checkpoint kept
    info = jobs.job_info(r, job_id)
    assert info.state == "cancelled" and 2 <= info.iteration < 300
    assert f"job {job_id}: cancelled" in procs.output(submit)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in metrics] == list(range(info.iteration))
    assert (run / "checkpoints" / f"iter_{info.iteration - 1:04d}" / "state.json").exists()
    assert "keeps the last checkpoint" in "\n".join(jobs.read_log(r, job_id)[0])

    events = timeline(run)
    tags = {e["worker"]: e["gpu_type"] for e in events if e["worker"] != "controller"}
    assert tags == {"rollout-gpua": "gpua", "trainer-gpub": "gpub", "rollout-gpuc": "gpuc"}
    kinds = {(e["worker"], e["kind"]) for e in events}
    assert ("rollout-gpua", "gen") in kinds and ("trainer-gpub", "train") in kinds
    assert min(e["iteration"] for e in joined) >= 1  # tagged at an iteration boundary of the running job
    assert metrics[-1]["workers"] == 3
