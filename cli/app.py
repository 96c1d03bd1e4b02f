"""The ``digen`` Typer app and what its command modules share: the consoles, the error handling
and the options several commands take. Command modules import from here and register on
:data:`app`; :mod:`digen.cli.main` imports them all.

Exit codes: 0 ok, 1 runtime failure, 2 bad input (a :class:`~digen.errors.ConfigError`).
"""

from __future__ import annotations

import functools
import logging
import os
import re
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

# digen never downloads: models are local folders. Quiet the libraries' own progress bars.
for _var, _val in (
    ("HF_HUB_OFFLINE", "1"),
    ("TRANSFORMERS_VERBOSITY", "error"),
    ("DIFFUSERS_VERBOSITY", "error"),
    ("HF_HUB_DISABLE_PROGRESS_BARS", "1"),
    ("TOKENIZERS_PARALLELISM", "false"),
):
    os.environ.setdefault(_var, _val)

from digen.cli.console import CONSOLE, RunLog  # noqa: E402
from digen.errors import ConfigError, DigenError  # noqa: E402

err = Console(stderr=True)
out = Console()

_KEY_VALUE = re.compile(r"^[A-Za-z_][\w-]*(\.[\w-]+)*=")
"""A Hydra-style ``key=value`` argument (``iterations=3``, ``train.lr=1e-4``)."""


def _plain_flags(params: list) -> list:
    """Give every flag (``--resume``, ``--help``) an empty type label: Typer's help shows a
    ``<bool>`` type beside flags, as if they took a value; they take none."""
    for p in params:
        if getattr(p, "is_flag", False) and getattr(p, "metavar", None) is None:
            p.metavar = ""
    return params


def _value_options(params: list) -> set[str]:
    """The option names of ``params`` that take a value (``--set``, ``--out``)."""
    names: set[str] = set()
    for p in params:
        if (
            p.param_type_name == "option"
            and not getattr(p, "is_flag", False)
            and not getattr(p, "count", False)
        ):
            names.update(p.opts)
    return names


def hydra_argument(args: list[str], value_options: set[str]) -> str | None:
    """The first ``key=value`` argument of ``args`` that is not an option's value (nor an
    existing file's name): a Hydra or VeRL-style override, which digen takes as ``--set
    key=value``."""
    previous = ""
    for arg in args:
        if arg == "--":
            return None
        if _KEY_VALUE.match(arg) and previous not in value_options and not Path(arg).exists():
            return arg
        previous = arg
    return None


class Command(typer.core.TyperCommand):
    """digen's commands: flags without a type label, and a Hydra-style ``key=value`` argument
    answered with one line suggesting ``--set key=value`` (exit 2) instead of Click's
    "unexpected extra argument"."""

    def get_params(self, ctx):
        return _plain_flags(super().get_params(ctx))

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        params = self.get_params(ctx)
        if any("--set" in getattr(p, "opts", ()) for p in params):
            arg = hydra_argument(args, _value_options(params))
            if arg is not None:
                err.print(
                    f"[red]error:[/red] {escape(arg)} is not an argument of digen {escape(ctx.info_name or '')}: "
                    f"did you mean --set {escape(arg)}?",
                    highlight=False,
                    soft_wrap=True,
                )
                ctx.exit(2)
        return super().parse_args(ctx, args)


class Group(typer.core.TyperGroup):
    """The ``digen`` group: its flags (``--help``, ``--version``) without a type label."""

    def get_params(self, ctx):
        return _plain_flags(super().get_params(ctx))


class Typer(typer.Typer):
    """A Typer app whose commands are :class:`Command` unless they name another class."""

    def command(self, *args, **kwargs):
        kwargs.setdefault("cls", Command)
        return super().command(*args, **kwargs)


app = Typer(
    cls=Group,
    add_completion=False,
    no_args_is_help=True,
    help="digen: disaggregated RL for diffusion models.",
)


def version() -> str:
    """The installed package's version (``digen --version``)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        return package_version("digen")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _print_version(value: bool) -> None:
    if value:
        out.print(f"digen {version()}", highlight=False, markup=False)
        raise typer.Exit(0)


@app.callback()
def _root(
    show_version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="Print digen's version and exit."
        ),
    ] = False,
) -> None:
    """digen: disaggregated RL for diffusion models."""


def print_table(table) -> None:
    """Print a Rich table on stdout. On a terminal Rich sizes it to the terminal's width
    (long cells fold or end in an ellipsis, as each column says); in a pipe or a file it
    is as wide as its longest words need (at least ``COLUMNS``, else 80), so no word, job id
    or path is cut at Rich's default width (``--json`` gives the same data for programs)."""
    if out.is_terminal:
        out.print(table)
        return
    width = max(out.width, out.measure(table, options=out.options.update_width(100_000)).minimum)
    Console(width=width, color_system=out.color_system and "auto", no_color=out.no_color).print(table)


ConfigArg = Annotated[Path, typer.Argument(help="YAML config (see configs/).")]
SetOpt = Annotated[
    list[str] | None, typer.Option("--set", help="Override a config key: --set rollout.group_size=4")
]
RedisOpt = Annotated[
    str | None,
    typer.Option(
        "--redis-url",
        envvar="DIGEN_REDIS_URL",
        help="Redis URL (redis://[user:password@]host:6379/0, rediss:// for TLS); default: the embedded "
        "Redis. Prefer DIGEN_REDIS_URL or --redis-url-file for a password (argv is visible in ps).",
    ),
]
RedisFileOpt = Annotated[
    Path | None,
    typer.Option(
        "--redis-url-file",
        envvar="DIGEN_REDIS_URL_FILE",
        help="A file (mode 600) holding the Redis URL on one line, password included.",
    ),
]
SchedOpt = Annotated[
    str | None,
    typer.Option(
        "--scheduler", help="Dask scheduler address (tls://host:8786); default: a local cluster on loopback."
    ),
]
SecurityOpt = Annotated[
    Path | None,
    typer.Option(
        "--security",
        help="This node's TLS files: a YAML with a security: section (digen certs writes one per node; "
        "a job config works).",
    ),
]
InsecureOpt = Annotated[
    bool,
    typer.Option(
        "--insecure",
        help="Allow a plain tcp:// scheduler or redis:// Redis on another host (anyone who reaches the "
        "scheduler can run code in the cluster, anyone on the path reads Redis; for a network isolated "
        "otherwise).",
    ),
]


def redis_url_from(url: str | None, url_file: Path | None, insecure: bool) -> str | None:
    """The Redis URL of ``--redis-url`` (or ``DIGEN_REDIS_URL``) or ``--redis-url-file``
    (None: the embedded one). A plain ``redis://`` to another host exits 2 unless
    ``insecure``, which prints one warning line, before anything connects."""
    from digen.controlplane.redis_conn import check_redis_url, read_url_file

    if url_file is not None:
        if url is not None:
            raise ConfigError(
                "give the Redis URL once: --redis-url (or DIGEN_REDIS_URL) or --redis-url-file, not both"
            )
        url, warning = read_url_file(url_file)
        if warning is not None:
            err.print(f"[yellow]warning:[/yellow] {escape(warning)}", highlight=False, soft_wrap=True)
    if url is None:
        return None
    warning = check_redis_url(url, insecure=insecure)
    if warning is not None:
        err.print(f"[yellow]warning:[/yellow] {escape(warning)}", highlight=False, soft_wrap=True)
    return url


def warn_insecure(scheduler: str | None, insecure: bool) -> None:
    """Refuse a plain ``tcp://`` scheduler on another host (exit 2, before anything connects)
    unless ``insecure``; then print one warning line."""
    if scheduler is None:
        return
    from digen.cluster.node import check_scheduler_address

    warning = check_scheduler_address(scheduler, insecure=insecure)
    if warning is not None:
        err.print(f"[yellow]warning:[/yellow] {escape(warning)}", highlight=False, soft_wrap=True)


def fail(exc: DigenError) -> None:
    """Print a DigenError as one red line (each problem on its own line) and exit. Messages
    are printed as text: brackets in them (``[one float per sample]``) are not Rich markup."""
    problems = getattr(exc, "problems", None) or [str(exc)]
    kept = _kept_log() if exc.exit_code != 2 else None  # a run that failed: where its log is
    if len(problems) == 1:
        where = f" (log: {kept})" if kept is not None else ""
        err.print(f"[red]error:[/red] {escape(problems[0] + where)}", highlight=False, soft_wrap=True)
    else:
        err.print(f"[red]error:[/red] {len(problems)} problems:", highlight=False)
        for p in problems:
            err.print(f"  - {escape(p)}", highlight=False, soft_wrap=True)
    raise typer.Exit(exc.exit_code)


def _kept_log() -> Path | None:
    """``RUN_DIR/digen.log`` when this command writes it (its run started, or the directory
    was new: then it is written now), else None."""
    for h in logging.getLogger().handlers:
        if isinstance(h, RunLog) and not h.discarded and (h.file is not None or h.fresh):
            h.open()
            return h.path if h.file is not None else None
    return None


def crash(exc: BaseException) -> None:
    """An error digen did not expect: one line on the console naming the log file that holds
    the traceback (``RUN_DIR/digen.log``; ``--verbose`` prints it here too), exit 1."""
    import traceback

    first = (str(exc).strip().splitlines() or [""])[0][:300]
    log_file = CONSOLE.get("log_file")
    record = logging.LogRecord("digen", logging.ERROR, __file__, 0, "failed: %s", (first,), None)
    record.exc_info = (type(exc), exc, exc.__traceback__)
    written = False
    for h in logging.getLogger().handlers:
        if isinstance(h, RunLog):
            h.open()
            written = h.write(record)
    if CONSOLE.get("verbose"):
        err.print("".join(traceback.format_exception(exc)), markup=False, highlight=False, end="")
        where = "above"
    elif written and log_file is not None:
        where = f"in {log_file} (--verbose prints it)"
    else:
        where = "not kept: rerun with --verbose to print it"
    err.print(
        f"[red]error:[/red] {escape(f'{type(exc).__name__}: {first}')}; the traceback is {escape(where)}",
        highlight=False,
        soft_wrap=True,
    )
    raise typer.Exit(1)


def handles_errors(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except DigenError as exc:
            from digen.rundir import DiskFull, RunDirBusy

            for h in logging.getLogger().handlers:
                # the directory is another run's, or its disk is full: write nothing more there
                if isinstance(h, RunLog) and (
                    isinstance(exc, RunDirBusy) or (isinstance(exc, DiskFull) and h.file is None)
                ):
                    h.discard()
            fail(exc)
        except KeyboardInterrupt:
            err.print("[yellow]interrupted[/yellow]")
            raise typer.Exit(130) from None
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except Exception as exc:  # noqa: BLE001 - one line and the log file, not a traceback
            crash(exc)

    return wrapper
