"""The ``digen`` command line (Typer). The only code that prints to the terminal or exits.

Exit codes: 0 ok, 1 runtime failure, 2 bad input (a :class:`~digen.errors.ConfigError`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

# digen never downloads: models are local folders. Quiet the libraries' own progress bars.
for _var, _val in (
    ("HF_HUB_OFFLINE", "1"),
    ("TRANSFORMERS_VERBOSITY", "error"),
    ("DIFFUSERS_VERBOSITY", "error"),
    ("HF_HUB_DISABLE_PROGRESS_BARS", "1"),
    ("TOKENIZERS_PARALLELISM", "false"),
):
    os.environ.setdefault(_var, _val)

from digen.errors import ConfigError, DigenError  # noqa: E402

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="digen: disaggregated RL for diffusion models."
)
err = Console(stderr=True)
out = Console()

ConfigArg = Annotated[Path, typer.Argument(help="YAML config (see configs/).")]
SetOpt = Annotated[
    list[str] | None, typer.Option("--set", help="Override a config key: --set rollout.group_size=4")
]
RedisOpt = Annotated[
    str | None, typer.Option("--redis-url", help="Redis URL; default: an embedded redis-server.")
]
SchedOpt = Annotated[
    str | None, typer.Option("--scheduler", help="Dask scheduler address; default: a LocalCluster.")
]


def fail(exc: DigenError) -> None:
    """Print a DigenError as one red line (each problem on its own line) and exit."""
    problems = getattr(exc, "problems", None) or [str(exc)]
    if len(problems) == 1:
        err.print(f"[red]error:[/red] {problems[0]}", highlight=False, soft_wrap=True)
    else:
        err.print(f"[red]error:[/red] {len(problems)} problems:", highlight=False)
        for p in problems:
            err.print(f"  - {p}", highlight=False, soft_wrap=True)
    raise typer.Exit(exc.exit_code)


def handles_errors(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except DigenError as exc:
            fail(exc)
        except KeyboardInterrupt:
            err.print("[yellow]interrupted[/yellow]")
            raise typer.Exit(130) from None

    return wrapper


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DASK_LOGGERS = ("distributed", "tornado", "bokeh")
"""Loggers of Dask's libraries: to the run's log file; on the console only with --verbose
(their errors always, as one line)."""


def _is_dask(record: logging.LogRecord) -> bool:
    return record.name.split(".")[0] in DASK_LOGGERS


class ConsoleFormatter(logging.Formatter):
    """digen's records as ``LEVEL name: message``; without --verbose a Dask error becomes one
    line that names the log file holding the rest."""

    def __init__(self, verbose: bool, log_file: Path | None):
        super().__init__("%(levelname)s %(name)s: %(message)s")
        self.verbose, self.log_file = verbose, log_file

    def format(self, record: logging.LogRecord) -> str:
        if self.verbose or not _is_dask(record):
            return super().format(record)
        first = (record.getMessage().strip().splitlines() or [""])[0]
        where = f"the full message is in {self.log_file}" if self.log_file else "rerun with --verbose"
        return (
            f"error from Dask ({record.name}): {first}; {where}. If the cluster cannot start, check "
            f"that no other digen run holds the CPU/GPU and rerun; --verbose shows Dask's log here"
        )


class RunLog(logging.Handler):
    """``RUN_DIR/digen.log`` (appended, INFO and up), held in memory until :meth:`open`: a
    command that fails before its run starts (bad input) leaves a stored run untouched; a
    fresh run directory gets the held lines at exit either way (:meth:`close`)."""

    def __init__(self, path: Path):
        super().__init__(logging.INFO)
        self.path = path
        self.fresh = not path.parent.exists() or not any(path.parent.iterdir())
        self.held: list[logging.LogRecord] = []
        self.file: logging.FileHandler | None = None
        self.setFormatter(logging.Formatter(LOG_FORMAT))

    def open(self) -> None:
        if self.file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.file = logging.FileHandler(self.path, encoding="utf-8")
            self.file.setFormatter(self.formatter)
            for rec in self.held:
                self.file.emit(rec)
            self.held = []

    def emit(self, record: logging.LogRecord) -> None:
        if self.file is not None:
            self.file.emit(record)
        elif len(self.held) < 100_000:
            self.held.append(record)

    def flush(self) -> None:
        if self.file is not None:
            self.file.flush()

    def close(self) -> None:
        if self.file is None and self.held and self.fresh:
            self.open()
        if self.file is not None:
            self.file.close()
        super().close()


def open_run_log() -> None:
    """Start writing ``RUN_DIR/digen.log`` (the run has started: its directory is checked)."""
    for h in logging.getLogger().handlers:
        if isinstance(h, RunLog):
            h.open()


def _quiet_dask(record: logging.LogRecord) -> bool:
    return not _is_dask(record) or record.levelno >= logging.ERROR


def _setup_logging(
    verbose: bool, log_file: Path | None = None, dask: bool = False, quiet: bool = False
) -> None:
    """Console: digen's warnings (errors only with ``quiet``, everything at INFO with
    ``verbose``); ``log_file`` (appended):
    INFO and up of digen and, with ``dask``, of Dask, whose own stderr handler is removed so
    its records reach these two. Without ``verbose`` Dask's worker processes print errors only."""
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "digen", False):  # a second call (tests, bench): replace, never stack
            root.removeHandler(h)
            h.close()
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(logging.INFO if verbose else logging.ERROR if quiet else logging.WARNING)
    console.setFormatter(ConsoleFormatter(verbose, log_file))
    if not verbose:
        console.addFilter(_quiet_dask)
    handlers: list[logging.Handler] = [console]
    if log_file is not None:
        handlers.append(RunLog(log_file))
    for h in handlers:
        h.digen = True  # type: ignore[attr-defined]
        root.addHandler(h)
    root.setLevel(logging.INFO if verbose or log_file is not None else logging.WARNING)
    if dask:
        _route_dask_logs(verbose)


def _route_dask_logs(verbose: bool) -> None:
    """Send Dask's records to the root handlers (they print to stderr on their own at import)."""
    import distributed  # noqa: F401 - its import installs the handlers removed here

    from digen.runtime import cluster

    for name in ("distributed", "distributed.client", "bokeh", "tornado", "tornado.application"):
        lg = logging.getLogger(name)
        for h in list(lg.handlers):
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
                lg.removeHandler(h)
        lg.propagate = True
    logging.getLogger("distributed").setLevel(logging.INFO)
    cluster.worker_console_level = logging.INFO if verbose else logging.ERROR


class Progress:
    """Live progress for ``digen train``: a rich display, JSON lines, or nothing.

    Called with each iteration's metrics row (``metrics.jsonl``'s keys). The rich display shows
    a bar with the iteration, then samples done, reward, samples/s, bubble ratio, policy version
    and staleness, and the workers' roles when the row carries ``roles`` (``{worker: role}``)
    or ``workers`` (a count). A message with an ``event`` key is an announcement, e.g.
    ``{"event": "start", "dashboard": URL, "roles": {...}}`` once the cluster is up: rich prints
    it above the bar, json prints it as a line.
    """

    def __init__(self, total: int, fmt: str):
        self.fmt, self.total = fmt, total
        self.samples = 0
        self.roles: dict[str, str] = {}
        self._live = None
        if fmt == "rich":
            from rich.console import Group
            from rich.live import Live
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )
            from rich.progress import Progress as Bar

            self._group = Group
            self._bar = Bar(
                TextColumn("[bold]train[/bold] iteration"),
                MofNCompleteColumn(),
                BarColumn(),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                console=err,
            )
            self._task = self._bar.add_task("train", total=total)
            from rich.text import Text

            starting = Text("starting: loading the model and the workers...", style="dim")
            self._live = Live(Group(self._bar, starting), console=err, refresh_per_second=4, transient=False)

    def __enter__(self):
        if self._live is not None:
            self._live.__enter__()
        return self

    def __exit__(self, *exc):
        if self._live is not None:
            self._live.__exit__(*exc)
            if not self._live.console.is_terminal:
                self._live.console.line()  # rich ends the last render with a newline only on a terminal

    def status_lines(self, m: dict) -> list[str]:
        """The text under the bar for metrics row ``m``."""
        line = (
            f"samples {self.samples}  reward {m.get('reward_mean', float('nan')):.4f} "
            f"± {m.get('reward_std', float('nan')):.4f}  {m.get('samples_per_s', 0.0):.1f} samples/s  "
            f"bubble {m.get('bubble_ratio', 0.0):.2f}  policy v{m.get('policy_version', '?')}  "
            f"staleness {m.get('max_staleness', 0)}"
        )
        lines = [line]
        if self.roles:
            lines.append("workers: " + "  ".join(f"{w} [{r}]" for w, r in sorted(self.roles.items())))
        elif "workers" in m:
            lines.append(f"workers: {m['workers']}")
        return lines

    def event(self, m: dict) -> None:
        if isinstance(m.get("roles"), dict):
            self.roles = {str(k): str(v) for k, v in m["roles"].items()}
        if self.fmt == "json":
            print(json.dumps(m), flush=True)
        elif self._live is not None:
            if m.get("dashboard"):
                self._live.console.print(f"Dask dashboard: {m['dashboard']}", highlight=False)
            extra = {k: v for k, v in m.items() if k not in ("event", "dashboard", "roles")}
            if extra:
                self._live.console.print(
                    f"{m['event']}: " + ", ".join(f"{k}={v}" for k, v in extra.items()), highlight=False
                )

    def __call__(self, m: dict) -> None:
        open_run_log()  # the run has started (its directory is checked)
        if "event" in m:
            self.event(m)
            return
        self.samples += int(m.get("samples", 0))
        if isinstance(m.get("roles"), dict):
            self.roles = {str(k): str(v) for k, v in m["roles"].items()}
        if self.fmt == "json":
            print(json.dumps(m), flush=True)
        elif self._live is not None:
            from rich.text import Text

            self._bar.update(self._task, completed=m["iteration"] + 1)
            self._live.update(self._group(self._bar, Text("\n".join(self.status_lines(m)))))


@app.command()
@handles_errors
def train(
    config: ConfigArg,
    out_dir: Annotated[
        Path | None, typer.Option("--out", help="Run directory (default runs/<config name>).")
    ] = None,
    set_: SetOpt = None,
    redis_url: RedisOpt = None,
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
) -> None:
    """Run a training job in the foreground (embedded Redis and Dask when no URL/address)."""
    from digen.config import load_config
    from digen.engine import run_training

    if log_format not in ("rich", "json", "quiet"):
        fail(ConfigError(f"--log-format ({log_format}) must be rich, json or quiet"))
    dash = ["cluster.local.dashboard=true"] if dashboard else []
    cfg = load_config(config, [*(set_ or []), *dash])
    if (
        scheduler is None
        and cfg.schedule.mode != "reference"
        and cfg.cluster.local.start_method == "forkserver"
    ):
        from digen.runtime.cluster import prefork_server

        prefork_server()  # before anything computes or starts a thread (see its docstring)
    profile = _start_profile() if profile_startup else None
    out_dir = out_dir or Path("runs") / config.stem
    _setup_logging(
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
            f"gain {summary['reward_gain_in_se']:.1f} s.e.\nrun directory: {out_dir}",
            highlight=False,
        )


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


@app.command("make-tiny-model")
@handles_errors
def make_tiny_model_cmd(
    out_dir: Annotated[Path, typer.Argument(help="Folder to write the diffusers pipeline into.")],
    arch: Annotated[
        str, typer.Option("--arch", help="sd3 | flux | qwen-image | wan | hunyuan-video")
    ] = "sd3",
    seed: Annotated[int, typer.Option("--seed")] = 0,
    resolution: Annotated[int, typer.Option("--resolution")] = 32,
) -> None:
    """Write a tiny random-weight diffusers pipeline folder (offline) for tests and demos."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from digen.models import make_tiny_model

    path = make_tiny_model(out_dir, arch=arch, seed=seed, resolution=resolution)
    out.print(f"wrote tiny {arch} pipeline to {path}")


# Command groups live in their own modules and register themselves on ``app``.
from cli import algorithms_cmd, bench, export_cmd, models_cmd, service, simulate  # noqa: E402,F401


def main() -> None:  # pragma: no cover
    # under ``python -m cli.main`` this file runs as __main__, a second copy of the module: the
    # command groups registered themselves on the importable ``cli.main.app``, so run that one
    from cli.main import app as registered

    registered()


if __name__ == "__main__":  # pragma: no cover
    main()
