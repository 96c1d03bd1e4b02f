"""The ``digen`` command line (Typer). The only code that prints to the terminal or exits.

Exit codes: 0 ok, 1 runtime failure, 2 bad input (a :class:`~digen.errors.ConfigError`).
"""

from __future__ import annotations

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


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


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
    log_format: Annotated[str, typer.Option("--log-format", help="rich | json | quiet")] = "rich",
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Run a training job in the foreground (embedded Redis and Dask when no URL/address)."""
    from digen.config import load_config
    from digen.engine import run_training

    _setup_logging(verbose)
    if log_format not in ("rich", "json", "quiet"):
        fail(ConfigError(f"--log-format ({log_format}) must be rich, json or quiet"))
    cfg = load_config(config, set_ or [])
    out_dir = out_dir or Path("runs") / config.stem
    with Progress(cfg.iterations, log_format) as progress:
        summary = run_training(
            cfg, out_dir, resume=resume, redis_url=redis_url, scheduler=scheduler, progress=progress
        )
    if log_format == "json":
        print(json.dumps({"summary": summary}), flush=True)
    elif log_format == "rich":
        out.print(
            f"[green]done[/green] {summary['iterations']} iterations, {summary['samples']} samples, "
            f"{summary['samples_per_s']:.2f} samples/s, bubble {summary['bubble_ratio']:.2f}\n"
            f"reward first 3 iterations {summary['reward_first']:.4f} ± {summary['reward_first_se']:.4f} (s.e.), "
            f"last 3 {summary['reward_last']:.4f} ± {summary['reward_last_se']:.4f}: "
            f"gain {summary['reward_gain_in_se']:.1f} s.e.\nrun directory: {out_dir}",
            highlight=False,
        )


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
from cli import bench, export_cmd, models_cmd, service, simulate  # noqa: E402,F401


def main() -> None:  # pragma: no cover
    # under ``python -m cli.main`` this file runs as __main__, a second copy of the module: the
    # command groups registered themselves on the importable ``cli.main.app``, so run that one
    from cli.main import app as registered

    registered()


if __name__ == "__main__":  # pragma: no cover
    main()
