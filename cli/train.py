"""``digen train``: a training job in the foreground, with its live progress and, on request,
its start-up profile."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from digen.cli.app import (
    ConfigArg,
    InsecureOpt,
    RedisFileOpt,
    RedisOpt,
    SchedOpt,
    SecurityOpt,
    SetOpt,
    app,
    err,
    handles_errors,
    out,
    redis_url_from,
    warn_insecure,
)
from digen.cli.console import setup_logging
from digen.cli.progress import Progress
from digen.errors import ConfigError


@app.command()
@handles_errors
def train(
    config: ConfigArg,
    out_dir: Annotated[
        Path | None, typer.Option("--out", help="Run directory (default runs/<config name>).")
    ] = None,
    set_: SetOpt = None,
    redis_url: RedisOpt = None,
    redis_url_file: RedisFileOpt = None,
    scheduler: SchedOpt = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue from the run directory's newest checkpoint.")
    ] = False,
    log_format: Annotated[
        str, typer.Option("--log-format", help="rich | json | quiet (quiet: errors only on the console)")
    ] = "rich",
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Also show Dask's log (always in RUN_DIR/digen.log).")
    ] = False,
    profile_startup: Annotated[
        bool,
        typer.Option(
            "--profile-startup",
            help="Time the start-up phases and sample the process tree's peak memory: "
            "RUN_DIR/startup.json and a table at the end.",
        ),
    ] = False,
    dashboard: Annotated[
        bool,
        typer.Option(
            "--dashboard", help="Serve the local cluster's Dask dashboard (cluster.local.dashboard)."
        ),
    ] = False,
    security: SecurityOpt = None,
    insecure: InsecureOpt = False,
) -> None:
    """Run a training job in the foreground (embedded Redis and Dask when no URL/address)."""
    from digen.engine import run_training

    warn_insecure(scheduler, insecure)  # before anything connects
    redis_url = redis_url_from(redis_url, redis_url_file, insecure)
    dash = ["cluster.local.dashboard=true"] if dashboard else []
    cfg, placement = _checked(config, [*(set_ or []), *dash], log_format, embedded=scheduler is None)
    if security is not None:  # this node's TLS files, over the config's security: section
        from digen.cluster.node import load_security

        cfg = cfg.model_copy(update={"security": load_security(security)})
    if placement is not None:
        _print_placement(placement, log_format)
    if (
        scheduler is None
        and cfg.schedule.mode != "reference"
        and cfg.cluster.local.start_method == "forkserver"
    ):
        from digen.cluster.cluster import prefork_server

        prefork_server()  # before anything computes or starts a thread (see its docstring)
    profile = _start_profile() if profile_startup else None
    out_dir = out_dir or Path("runs") / config.stem
    setup_logging(
        verbose, out_dir / "digen.log", dask=cfg.schedule.mode != "reference", quiet=log_format == "quiet"
    )
    with _profiled(profile, out_dir) as report, Progress(cfg.iterations, log_format) as progress:
        summary = run_training(
            cfg, out_dir, resume=resume, redis_url=redis_url, scheduler=scheduler, progress=progress
        )
    if report:
        if log_format == "json":
            print(json.dumps({"startup": report}), flush=True)
        else:
            from digen.startup import format_profile

            err.print("\n".join(format_profile(report)), highlight=False, markup=False)
    if log_format == "json":
        print(json.dumps({"summary": summary}), flush=True)
    elif log_format == "rich":
        n = min(3, summary["iterations"])  # summary.json's reward windows (digen.rundir)
        out.print(
            f"[green]done[/green] {summary['iterations']} iterations, {summary['samples']} samples, "
            f"{summary['samples_per_s']:.2f} samples/s, bubble {summary['bubble_ratio']:.2f}\n"
            f"reward first {n} iteration{'s' if n > 1 else ''} {summary['reward_first']:.4f} ± {summary['reward_first_se']:.4f} (s.e.), "
            f"last {n} {summary['reward_last']:.4f} ± {summary['reward_last_se']:.4f}: "
            f"gain {summary['reward_gain_in_se']:.1f} s.e.\nrun directory: {escape(str(out_dir))}",
            highlight=False,
        )


LOG_FORMATS = ("rich", "json", "quiet")


def _checked(config: Path, overrides: list[str], log_format: str, *, embedded: bool):
    """The config and, for a run on the embedded cluster (no ``--scheduler``, not the
    reference mode), its workers' placement on this machine's GPUs (``digen plan``; None
    otherwise). Every problem of the three (``--log-format``, the config's own, the placement's)
    is reported together, in one :class:`ConfigError` (exit 2), before anything starts.

    ``train.algorithm`` is checked with the rewards by ``check_inputs`` (in a child process for
    the distributed modes): the algorithm registry imports torch, which the controller does not.
    The placement is planned once the config has its keys and types (it reads them)."""
    from digen.config import load_config

    problems = (
        [] if log_format in LOG_FORMATS else [f"--log-format ({log_format}) must be rich, json or quiet"]
    )
    planned = []

    def placement_problems(cfg) -> list[str]:
        if not embedded or cfg.schedule.mode == "reference":
            return []
        from digen.cluster.placement import plan_local

        try:
            planned.append(plan_local(cfg))
        except ConfigError as exc:  # workers that do not fit the GPUs, GPUs that are not here
            return exc.problems
        return []

    try:
        cfg = load_config(config, overrides, algorithms=False, also=placement_problems)
    except ConfigError as exc:
        raise ConfigError(problems + exc.problems) from None
    if problems:
        raise ConfigError(problems)
    return cfg, (planned[0] if planned else None)


def _print_placement(placement, log_format: str) -> None:
    """The embedded cluster's placement (``digen plan``), one line per worker, before it starts."""
    if log_format == "json":
        print(json.dumps({"placement": placement.to_json()}), flush=True)
    elif log_format == "rich":
        err.print("\n".join(placement.lines()), style="dim", highlight=False, markup=False)


def _start_profile():
    """A start-up profile whose ``imports`` phase runs from the process start to now."""
    import time

    from digen.startup import StartupProfile

    profile = StartupProfile()
    profile.add("imports", profile.t0, time.time())
    return profile


@contextlib.contextmanager
def _profiled(profile, out_dir: Path):
    """Record ``profile`` and the process tree's peak memory around the block; the dict it
    yields is filled with the profile's JSON afterwards (also written to RUN_DIR/startup.json)."""
    report: dict = {}
    if profile is None:
        yield report
        return
    from digen.rundir import _read_jsonl
    from digen.startup import TreeMemorySampler, profiling

    with TreeMemorySampler() as mem, profiling(profile):
        yield report
    timeline = _read_jsonl(out_dir / "timeline.jsonl")
    report.update(profile.to_json(timeline, mem.peak_mb, mem.peak_pss_mb, mem.peak_breakdown()))
    (out_dir / "startup.json").write_text(json.dumps(report, indent=1))
