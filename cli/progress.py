"""Live progress: ``digen train``'s (:class:`Progress`: a rich display, JSON lines, or
nothing) and that of a command made of steps (:class:`Steps`: ``digen simulate``, ``digen
bench``)."""

from __future__ import annotations

import json

from rich.markup import escape

from digen.cli.app import err
from digen.cli.console import PROGRESS_LOG, open_run_log


class Progress:
    """Live progress for ``digen train``: a rich display, JSON lines, or nothing.

    Called with each iteration's metrics row (``metrics.jsonl``'s keys). The rich display shows
    a bar with the iteration, then samples done, reward, samples/s, bubble ratio, policy version
    and staleness, and the workers' roles when the row carries ``roles`` (``{worker: role}``)
    or ``workers`` (a count). A message with an ``event`` key is an announcement, e.g.
    ``{"event": "start", "dashboard": URL, "roles": {...}}`` once the cluster is up: rich prints
    it above the bar, json prints it as a line. ``{"event": "interrupted"}`` (a Ctrl-C) stops
    the display at once. ``{"event": "progress", "iteration", "generated", "trained",
    "samples"}`` (:func:`digen.iteration.within_iteration`, as tasks finish) is shown under the
    bar (``iteration 5/70: generated 40/80 samples, trained 16/80``), printed as a json line,
    and not written to ``digen.log``, which keeps one line per iteration.
    """

    def __init__(self, total: int, fmt: str):
        self.fmt, self.total = fmt, total
        self.samples = 0
        self.roles: dict[str, str] = {}
        self._live = None
        self._within = ""  # where the iteration in progress stands
        self._status: list[str] = []  # the last iteration's numbers
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
        self.stop()

    def stop(self) -> None:
        """Stop the display (once): at the end, or at once on ``{"event": "interrupted"}``
        (a Ctrl-C), so the bar does not tick while the job shuts down."""
        live, self._live = self._live, None
        if live is not None:
            live.stop()
            if not live.console.is_terminal:
                live.console.line()  # rich ends the last render with a newline only on a terminal

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
        if m.get("event") == "interrupted":  # the CLI prints what the run keeps
            self.stop()
            return
        if m.get("event") == "resumed" and self.fmt == "rich" and self._live is not None:
            from digen.iteration import progress_line

            self._bar.update(self._task, completed=int(m["iteration"]) + 1)  # the done ones
            self._live.console.print(
                progress_line(m, self.total), highlight=False, markup=False, soft_wrap=True
            )
            return
        if isinstance(m.get("roles"), dict):
            self.roles = {str(k): str(v) for k, v in m["roles"].items()}
        if self.fmt == "json":
            print(json.dumps(m), flush=True)
        elif self._live is not None:
            if m.get("dashboard"):
                self._live.console.print(f"Dask dashboard: {m['dashboard']}", highlight=False, markup=False)
            extra = {k: v for k, v in m.items() if k not in ("event", "dashboard", "roles")}
            if extra:
                self._live.console.print(
                    f"{m['event']}: " + ", ".join(f"{k}={v}" for k, v in extra.items()),
                    highlight=False,
                    markup=False,
                )

    def within_line(self, m: dict) -> str:
        """The line under the bar within an iteration (``{"event": "progress", ...}``)."""
        n = m.get("samples", 0)
        return (
            f"iteration {int(m['iteration']) + 1}/{self.total}: generated {m.get('generated', 0)}/{n} "
            f"samples, trained {m.get('trained', 0)}/{n}"
        )

    def _render(self) -> None:
        from rich.text import Text

        if self._live is None:
            return
        lines = ([self._within] if self._within else []) + self._status
        self._live.update(self._group(self._bar, Text("\n".join(lines))))

    def __call__(self, m: dict) -> None:
        from digen.iteration import progress_line

        if m.get("event") == "progress":  # within an iteration: shown, not logged (many a second)
            if self.fmt == "json":
                print(json.dumps(m), flush=True)
            elif self._live is not None:
                self._within = self.within_line(m)
                self._render()
            return
        open_run_log()  # the run has started (its directory is checked)
        PROGRESS_LOG.info("%s", progress_line(m, self.total))  # RUN_DIR/digen.log, every mode
        if "event" in m:
            self.event(m)
            return
        self.samples += int(m.get("samples", 0))
        if isinstance(m.get("roles"), dict):
            self.roles = {str(k): str(v) for k, v in m["roles"].items()}
        if self.fmt == "json":
            print(json.dumps(m), flush=True)
        elif self._live is not None:
            self._bar.update(self._task, completed=m["iteration"] + 1)
            self._within, self._status = "", self.status_lines(m)
            self._render()


class Steps:
    """The progress of a command made of steps (``digen simulate``'s modes, ``digen bench``'s
    runs): on a terminal a Rich bar on stderr naming the step that runs; elsewhere (a pipe,
    a log file, a test) one line per step as it starts, ``<what>: step i/n <label>``, so a
    log shows where a long command is and the first line comes at once. Lines printed on
    :data:`digen.cli.app.err` meanwhile appear above the bar."""

    def __init__(self, what: str, total: int):
        self.what, self.total, self.done = what, total, 0  # done: steps started
        self._bar = None
        if err.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as Bar

            self._bar = Bar(
                TextColumn(f"[bold]{escape(what)}[/bold]"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.description}"),
                console=err,
                transient=True,
            )
            self._task = self._bar.add_task("", total=total)

    def __enter__(self):
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.stop()

    def start(self, label: str) -> None:
        """The next step, ``label``, starts (the steps before it are done)."""
        self.done += 1
        self.total = max(self.total, self.done)
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done - 1, total=self.total, description=escape(label))
        else:
            err.print(
                f"{self.what}: step {self.done}/{self.total} {label}",
                highlight=False,
                markup=False,
                soft_wrap=True,
            )
