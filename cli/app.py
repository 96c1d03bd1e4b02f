"""The ``digen`` Typer app and what its command modules share: the consoles, the error handling
and the options several commands take. Command modules import from here and register on
:data:`app`; :mod:`cli.main` imports them all.

Exit codes: 0 ok, 1 runtime failure, 2 bad input (a :class:`~digen.errors.ConfigError`).
"""

from __future__ import annotations

import functools
import os
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

from digen.errors import DigenError  # noqa: E402

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
