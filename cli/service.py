"""digen CLI commands: service (registered on digen.cli.app.app).

``submit``, ``status``, ``logs``, ``cancel`` talk to the job queue in Redis
(:mod:`digen.service.jobs`), ``serve`` runs the jobs (:mod:`digen.service.runner`);
``worker`` starts a Dask worker node (:mod:`digen.cluster.node`).
With no ``--redis-url`` (and no ``DIGEN_REDIS_URL``) they share the embedded Redis under
``$DIGEN_HOME``: ``digen serve --burst & digen submit CONFIG --wait`` works with nothing installed.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from digen.cli.app import (
    InsecureOpt,
    RedisFileOpt,
    RedisOpt,
    SecurityOpt,
    SetOpt,
    app,
    err,
    handles_errors,
    out,
    print_table,
    redis_url_from,
    warn_insecure,
)
from digen.errors import ConfigError

JobArg = Annotated[str, typer.Argument(help="Job id (digen status lists them).")]

_STATE_STYLE = {
    "done": "green",
    "running": "cyan",
    "starting": "cyan",
    "queued": "white",
    "failed": "red",
    "lost": "red",
    "cancelled": "yellow",
    "cancelling": "yellow",
    "resumed": "magenta",
}


def _connect(url: str | None):
    from digen.controlplane.embedded import connect_service

    return connect_service(url)


def _when(ts: float | None) -> str:
    return time.strftime("%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


def _follow(r, job_id: str) -> int:
    """Print the job's log as it grows until it ends; exit code 0 if it finished."""
    from digen.service.jobs import follow

    info = follow(r, job_id, lambda line: err.print(line, highlight=False, markup=False, soft_wrap=True))
    style = _STATE_STYLE.get(info.state, "white")
    err.print(
        f"job {escape(job_id)}: [{style}]{info.state}[/{style}] after {info.iteration}/{info.total} iterations"
        + (f"; resumed as {info.resumed_by}" if info.resumed_by else "")
        + (f"; {escape(info.error)}" if info.error and info.state == "failed" else ""),
        highlight=False,
    )
    return 0 if info.state == "done" else 1


@app.command()
@handles_errors
def submit(
    config: Annotated[
        Path | None, typer.Argument(help="YAML config (see configs/); omit with --resume.")
    ] = None,
    set_: SetOpt = None,
    redis_url: RedisOpt = None,
    redis_url_file: RedisFileOpt = None,
    out_dir: Annotated[
        Path | None,
        typer.Option(
            "--out", help="Run directory (default runs/<config>-<job id>); must be visible to digen serve."
        ),
    ] = None,
    wait: Annotated[
        bool, typer.Option("--wait", help="Follow the job's log until it ends; exit 0 only if it finished.")
    ] = False,
    resume: Annotated[
        str | None,
        typer.Option(
            "--resume",
            metavar="JOB",
            help="Continue a stopped job's run directory from its newest checkpoint, as a new job.",
        ),
    ] = None,
    retries: Annotated[
        int,
        typer.Option(
            "--retries",
            help="Automatic re-runs after the runner crashes or dies (each resumes from the checkpoint).",
        ),
    ] = 2,
    timeout: Annotated[
        str, typer.Option("--timeout", help="Wall-clock limit of the job: 3600, 90m, 12h, 7d.")
    ] = "7d",
    check_paths: Annotated[
        bool,
        typer.Option(
            "--check-paths/--no-check-paths",
            help="Check that model and prompt files exist here (skip when "
            "they exist only where digen serve runs).",
        ),
    ] = True,
    insecure: InsecureOpt = False,
) -> None:
    """Queue a training job for digen serve; prints its id."""
    from digen.service import jobs

    redis_url = redis_url_from(redis_url, redis_url_file, insecure)  # before anything is read

    timeout_s = jobs.parse_duration(timeout)
    if resume is not None:
        if config is not None or set_ or out_dir is not None:
            raise ConfigError(
                "--resume JOB continues that job's own config and run directory: drop CONFIG, --set and --out"
            )
        r = _connect(redis_url)
        job_id = jobs.resume(r, resume, retries=retries, timeout_s=timeout_s)
    else:
        if config is None:
            raise ConfigError("give a CONFIG to submit (e.g. configs/quickstart.yaml) or --resume JOB")
        from digen.config import load_config

        cfg = load_config(
            config, set_ or [], check_paths=check_paths
        )  # bad input stops here: nothing enqueued
        job_id = jobs.new_job_id()
        run_dir = out_dir or Path("runs") / f"{config.stem}-{job_id}"
        from digen.checks import check_inputs

        check_inputs(cfg, run_dir, files=check_paths)  # every input, before anything is enqueued
        r = _connect(redis_url)
        jobs.submit(
            r, cfg, run_dir, job_id=job_id, retries=retries, timeout_s=timeout_s, config_name=config.stem
        )
    print(job_id, flush=True)
    _warn_no_runner(r, job_id)
    if wait:
        raise typer.Exit(_follow(r, job_id))


def _warn_no_runner(r, job_id: str) -> None:
    """One warning line when no ``digen serve`` is up on this Redis: the job waits queued."""
    from digen.service.jobs import live_runners

    if not live_runners(r):
        err.print(
            f"[yellow]warning:[/yellow] no digen serve is running on this Redis: job {escape(job_id)} "
            f"waits in the queue until one starts (digen serve, with the same --redis-url)",
            highlight=False,
            soft_wrap=True,
        )


@app.command()
@handles_errors
def serve(
    redis_url: RedisOpt = None,
    redis_url_file: RedisFileOpt = None,
    scheduler: Annotated[
        str | None,
        typer.Option(
            "--scheduler",
            envvar="DIGEN_SCHEDULER",
            help="Dask scheduler the jobs use (tcp:// or tls://); default: a LocalCluster per job from the "
            "config's cluster.local.",
        ),
    ] = None,
    burst: Annotated[
        bool,
        typer.Option(
            "--burst", help="Run the queued jobs, then exit (waits up to --burst-wait for a first one)."
        ),
    ] = False,
    burst_wait: Annotated[
        float, typer.Option("--burst-wait", help="Seconds --burst waits for a first job.")
    ] = 30.0,
    name: Annotated[
        str | None,
        typer.Option("--name", help="Worker name shown by rq and digen status; unique among running serves."),
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log every job start and end.")] = False,
    security: SecurityOpt = None,
    insecure: InsecureOpt = False,
) -> None:
    """Run submitted jobs (an rq worker; each job runs the controller)."""
    from digen.cluster.node import load_security
    from digen.controlplane.redis_conn import embedded_url, mask_url
    from digen.service import runner

    warn_insecure(scheduler, insecure)
    redis_url = redis_url_from(redis_url, redis_url_file, insecure)
    sec = load_security(security) if security is not None else None
    r = _connect(redis_url)
    url = redis_url or embedded_url(r)
    where = f"{mask_url(redis_url)}" if redis_url else "the embedded Redis"
    err.print(
        f"digen serve: jobs from {where}, cluster "
        f"{scheduler or 'a LocalCluster per job'}{' (burst)' if burst else ''}",
        highlight=False,
        markup=False,
    )
    ran = runner.serve(
        r,
        url,
        scheduler=scheduler,
        burst=burst,
        burst_wait_s=burst_wait,
        name=name,
        verbose=verbose,
        security=sec,
        insecure=insecure,
    )
    if burst and not ran:
        err.print(f"no job arrived within {burst_wait:g} s; nothing to do", highlight=False)


@app.command()
@handles_errors
def status(
    job: Annotated[str | None, typer.Argument(help="Show one job in detail.")] = None,
    redis_url: RedisOpt = None,
    redis_url_file: RedisFileOpt = None,
    json_: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    limit: Annotated[int, typer.Option("--limit", help="Newest N jobs (0: all).")] = 20,
    insecure: InsecureOpt = False,
) -> None:
    """Jobs and their progress: state, iteration/total, reward, samples/s, started, run dir."""
    from digen.service import jobs

    redis_url = redis_url_from(redis_url, redis_url_file, insecure)

    r = _connect(redis_url)
    if job is not None:
        info = jobs.job_info(r, job)
        if json_:
            print(json.dumps(info.to_json()), flush=True)
            return
        for key, value in info.to_json().items():
            if key in ("submitted", "started", "ended"):
                value = _when(value)
            out.print(f"{key:>13}: {value if value is not None else '-'}", highlight=False, markup=False)
        return
    listed = jobs.list_jobs(r, limit)
    if json_:
        print(json.dumps([j.to_json() for j in listed]), flush=True)
        return
    if not listed:
        out.print("no jobs; submit one with digen submit CONFIG")
        return
    from rich.table import Table

    table = Table(box=None, header_style="bold")
    junk = any(j.quarantined for j in listed)  # junk read from Redis, moved to the dead letters
    cols = ("JOB", "STATE", "ITER", "REWARD", "SAMPLES/S", "STARTED", *(("QUARANTINED",) if junk else ()))
    for col in cols:  # a job id stays whole (it is what logs and cancel take); the rest may shorten
        table.add_column(col, no_wrap=col == "JOB", overflow="ellipsis", min_width=len(col))
    table.add_column("RUN DIR", overflow="fold")
    for j in listed:
        style = _STATE_STYLE.get(j.state, "white")
        table.add_row(
            escape(j.id),
            f"[{style}]{j.state}[/{style}]",
            f"{j.iteration}/{j.total}",
            "-" if j.reward is None else f"{j.reward:.4f}",
            "-" if j.samples_per_s is None else f"{j.samples_per_s:.2f}",
            _when(j.started),
            *((str(j.quarantined),) if junk else ()),
            escape(j.run_dir),
        )
    print_table(table)
    n, last = jobs.refused(r)
    if n:  # rq jobs that were not digen's: never run (see digen.service.jobs)
        out.print(
            f"{n} rq job{'s' if n != 1 else ''} refused (not digen's job); newest: {last}",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )


@app.command()
@handles_errors
def logs(
    job: JobArg,
    redis_url: RedisOpt = None,
    redis_url_file: RedisFileOpt = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing until the job ends.")] = False,
    insecure: InsecureOpt = False,
) -> None:
    """A job's log: progress lines, warnings, the outcome."""
    from digen.service import jobs

    redis_url = redis_url_from(redis_url, redis_url_file, insecure)

    r = _connect(redis_url)
    jobs.job_info(r, job)  # an unknown id is an error, not an empty log
    if follow:
        raise typer.Exit(_follow(r, job))
    lines, _ = jobs.read_log(r, job)
    for line in lines:
        out.print(line, highlight=False, markup=False, soft_wrap=True)


@app.command()
@handles_errors
def cancel(
    job: JobArg,
    redis_url: RedisOpt = None,
    redis_url_file: RedisFileOpt = None,
    wait: Annotated[bool, typer.Option("--wait", help="Wait until the job has stopped.")] = False,
    insecure: InsecureOpt = False,
) -> None:
    """Stop a job at its next safe point (after a checkpoint); the run directory is kept."""
    from digen.service import jobs

    redis_url = redis_url_from(redis_url, redis_url_file, insecure)

    r = _connect(redis_url)
    was = jobs.cancel(r, job)
    if was in ("running", "starting", "cancelling"):
        err.print(
            f"job {job}: cancel requested; it stops within one task, keeping the last checkpoint",
            highlight=False,
            markup=False,
        )
        if wait:
            info = jobs.follow(r, job, lambda line: None)
            err.print(
                f"job {job}: {info.state} after {info.iteration}/{info.total} iterations",
                highlight=False,
                markup=False,
            )
    else:
        err.print(f"job {job}: cancelled (it was {was})", highlight=False, markup=False)


@app.command()
@handles_errors
def worker(
    scheduler: Annotated[
        str,
        typer.Option(
            "--scheduler", envvar="DIGEN_SCHEDULER", help="Dask scheduler address, e.g. tcp://head:8786."
        ),
    ],
    role: Annotated[
        str,
        typer.Option(
            "--role",
            help="rollout | trainer | reward (only scores); with --gpus, counts too: trainer=2,rollout",
        ),
    ],
    gpu_type: Annotated[
        str | None,
        typer.Option(
            "--gpu-type", help="GPU type tag, e.g. h100, a10g, cpu (with --gpus: read from the GPUs)."
        ),
    ] = None,
    gpus: Annotated[
        str | None,
        typer.Option(
            "--gpus",
            help="auto | 0,1,2,3: one worker process per GPU of this node, each seeing only its own.",
        ),
    ] = None,
    device: Annotated[
        str | None,
        typer.Option("--device", help="cpu | cuda | cuda:N (default: the job config's model.device)."),
    ] = None,
    nthreads: Annotated[int, typer.Option("--nthreads", help="Threads of the Dask worker.")] = 1,
    name: Annotated[
        str | None, typer.Option("--name", help="Worker name (default <role>-<gpu type>-<host>-<id>).")
    ] = None,
    host: Annotated[
        str | None,
        typer.Option(
            "--host",
            help="Address to listen on and advertise (default: the one that routes to the scheduler; "
            "127.0.0.1 for a scheduler on this host).",
        ),
    ] = None,
    security: SecurityOpt = None,
    insecure: InsecureOpt = False,
    sp_group: Annotated[
        str | None,
        typer.Option(
            "--sp-group",
            help="Rollout workers with the same group name form sequence-parallel replicas together "
            "(rollout.sequence_parallel), instead of grouping by GPU type.",
        ),
    ] = None,
) -> None:
    """Start a Dask worker with a role and GPU type (with --gpus: one per GPU); running jobs use it from their next iteration."""
    from digen.cluster.node import load_security, node_placement, run_node_workers, run_worker

    warn_insecure(scheduler, insecure)
    sec = load_security(security) if security is not None else None
    if gpus is not None:
        if device is not None or name is not None:
            raise ConfigError("--gpus starts one worker per GPU: drop --device and --name")
        placement = node_placement(role, gpus, gpu_type)
        kinds = {s.worker: f"{s.role}, gpu-{s.gpu_type}, GPU {s.gpus[0]}" for s in placement.slots}
        run_node_workers(
            scheduler,
            placement,
            nthreads=nthreads,
            host=host,
            security=sec,
            on_ready=lambda worker_name, address: _joined(
                worker_name, kinds[worker_name], scheduler, address
            ),
            sp_group=sp_group,
            insecure=insecure,
        )
        return
    if gpu_type is None:
        raise ConfigError("--gpu-type is required without --gpus (e.g. --gpu-type h100, or cpu)")

    run_worker(
        scheduler,
        role,
        gpu_type,
        name=name,
        device=device,
        nthreads=nthreads,
        host=host,
        security=sec,
        on_ready=lambda worker_name, address: _joined(
            worker_name, f"{role}, gpu-{gpu_type}", scheduler, address
        ),
        sp_group=sp_group,
        insecure=insecure,
    )


def _joined(worker_name: str, kind: str, scheduler: str, address: str) -> None:
    """The line ``digen worker`` prints when a worker (``kind``: its role and GPU) joined."""
    err.print(f"digen worker {worker_name} ({kind}) joined {scheduler} from {address}", highlight=False)
