"""The run directory: config, metrics, timeline, samples, checkpoints, summary.

Layout (DESIGN.md section 3)::

    config.yaml  metrics.jsonl  timeline.jsonl  summary.json
    samples/iter_NNNN.png  timeline.png  rewards.png
    checkpoints/iter_NNNN/{weights,optimizer}.safetensors state.json

``checkpoints/iter_NNNN`` holds the state *after* iteration NNNN's optimizer step. Resuming
from it truncates ``metrics.jsonl`` and ``timeline.jsonl`` to iterations <= NNNN, so a run
killed at any point and resumed has every iteration exactly once.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

from digen.config import Config, dump_config
from digen.errors import CheckpointError, ConfigError


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line cut by a crash: everything after it is dropped
    return rows


class RunDir:
    """Writes one run's files. ``resume`` picks up the newest readable checkpoint."""

    def __init__(self, root: Path, cfg: Config, *, resume: bool = False):
        self.root = Path(root)
        self.cfg = cfg
        self.root.mkdir(parents=True, exist_ok=True)
        self.checkpoints = self.root / "checkpoints"
        self.samples = self.root / "samples"
        if not resume and (self.root / "metrics.jsonl").exists() and _read_jsonl(self.root / "metrics.jsonl"):
            raise ConfigError(
                f"run directory {self.root} already holds a run; pass --resume to continue it or choose "
                f"another --out"
            )
        if not resume:  # a resume writes it once its checkpoint has loaded: a failed one changes nothing
            self.write_config()

    def write_config(self) -> None:
        (self.root / "config.yaml").write_text(dump_config(self.cfg))

    # --- checkpoints ---------------------------------------------------------------
    def checkpoint_dir(self, iteration: int) -> Path:
        return self.checkpoints / f"iter_{iteration:04d}"

    def latest_checkpoint(self) -> Path | None:
        """The newest complete checkpoint (one with ``state.json``, written last)."""
        if not self.checkpoints.exists():
            return None
        done = sorted(p for p in self.checkpoints.glob("iter_*") if (p / "state.json").exists())
        return done[-1] if done else None

    def prune_checkpoints(self) -> None:
        prune_checkpoints(self.checkpoints, self.cfg.output.keep_checkpoints)

    def truncate_after(self, iteration: int) -> None:
        """Resume from ``iteration``'s checkpoint: drop metrics and timeline rows of later
        iterations and write this run's ``config.yaml``."""
        self.write_config()
        for name in ("metrics.jsonl", "timeline.jsonl", "eval.jsonl"):
            path = self.root / name
            rows = [r for r in _read_jsonl(path) if int(r.get("iteration", -1)) <= iteration]
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    # --- logs ------------------------------------------------------------------------
    def append(self, name: str, rows: list[dict[str, Any]]) -> None:
        with open(self.root / name, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
            f.flush()

    def metrics(self) -> list[dict]:
        return _read_jsonl(self.root / "metrics.jsonl")

    def timeline(self) -> list[dict]:
        return _read_jsonl(self.root / "timeline.jsonl")

    def write_summary(self, mode: str) -> dict:
        """``summary.json`` from ``metrics.jsonl`` (and returns it)."""
        rows = self.metrics()
        if not rows:
            raise CheckpointError(f"{self.root}/metrics.jsonl is empty: no iteration finished")
        samples = sum(r["samples"] for r in rows)
        wall = sum(r["wall_s"] for r in rows)
        busy_total, worker_total = self._busy_and_worker_seconds(rows)
        head, tail = rows[:3], rows[-3:]
        first, first_se = _mean_se(head)
        last, last_se = _mean_se(tail)
        summary = {
            "mode": mode,
            "iterations": len(rows),
            "samples": samples,
            "wall_s": round(wall, 4),
            "samples_per_s": samples / wall if wall > 0 else 0.0,
            "bubble_ratio": 1 - busy_total / worker_total if worker_total > 0 else 0.0,
            "reward_first": first,
            "reward_last": last,
            "reward_first_se": first_se,
            "reward_last_se": last_se,
            "reward_gain_in_se": (last - first) / math.hypot(first_se, last_se)
            if math.hypot(first_se, last_se) > 0
            else 0.0,
            "max_staleness": max(r["max_staleness"] for r in rows),
        }
        (self.root / "summary.json").write_text(json.dumps(summary, indent=1))
        return summary

    def _busy_and_worker_seconds(self, rows: list[dict]) -> tuple[float, float]:
        """Busy and available worker-seconds over the run, from the whole timeline (a task
        that straddles an iteration boundary counts in full, which per-iteration rows, written
        before it ends, cannot do); falls back to the metrics rows."""
        events = [e for e in self.timeline() if e.get("role") != "controller" and e.get("kind") != "sync"]
        wall = sum(r["wall_s"] for r in rows)
        workers = max((int(r.get("workers", 1)) for r in rows), default=1)
        if events and wall > 0:
            return sum(e["end"] - e["start"] for e in events), workers * wall
        return sum(r.get("busy_s", 0.0) for r in rows), sum(r.get("worker_s", 0.0) for r in rows)


def finalize_checkpoint(folder: Path, keep: int) -> None:
    """Make the staged checkpoint ``iter_NNNN.tmp`` beside ``folder`` the checkpoint ``folder``
    (one rename), then keep the newest ``keep`` of its parent (:func:`prune_checkpoints`)."""
    tmp = folder.with_name(folder.name + ".tmp")
    if folder.exists():
        shutil.rmtree(folder)
    tmp.rename(folder)
    prune_checkpoints(folder.parent, keep)


def prune_checkpoints(folder: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` complete checkpoints in ``folder`` (``iter_NNNN``)."""
    done = sorted(p for p in folder.glob("iter_*") if (p / "state.json").exists())
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def _mean_se(rows: list[dict]) -> tuple[float, float]:
    """Mean reward over the samples of ``rows`` and its standard error (from each
    iteration's mean, std and sample count)."""
    n = sum(r["samples"] for r in rows)
    if n == 0:
        return 0.0, 0.0
    mean = sum(r["reward_mean"] * r["samples"] for r in rows) / n
    # pooled variance around the pooled mean
    ss = sum(r["samples"] * (r["reward_std"] ** 2 + (r["reward_mean"] - mean) ** 2) for r in rows)
    var = ss / max(n - 1, 1)
    return mean, math.sqrt(var / n)
