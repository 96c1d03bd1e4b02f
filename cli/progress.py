"""The live progress of ``digen train``: a rich display, JSON lines, or nothing."""

from __future__ import annotations

import json

from cli.app import err
from cli.console import open_run_log


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
                self._live.console.print(f"Dask dashboard: {m['dashboard']}", highlight=False, markup=False)
            extra = {k: v for k, v in m.items() if k not in ("event", "dashboard", "roles")}
            if extra:
                self._live.console.print(
                    f"{m['event']}: " + ", ".join(f"{k}={v}" for k, v in extra.items()),
                    highlight=False,
                    markup=False,
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
