"""A run directory as the simulator reads it (:mod:`digen.sim.calibrate`,
:mod:`digen.sim.sp_calibration`): ``config.yaml`` and the JSONL files that ``digen train``
wrote (:mod:`digen.rundir`), a missing file being a :class:`~digen.errors.ConfigError` that
names it, and which timeline rows stand for a task.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from digen.errors import ConfigError
from digen.rundir import _read_jsonl


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a run's JSONL file (up to a line cut by a crash)."""
    if not path.exists():
        raise ConfigError(f"{path} does not exist: pass a run directory written by digen train")
    return _read_jsonl(path)


def read_config(run: Path) -> dict:
    """The run's ``config.yaml`` as a dict (resolved, as the run wrote it)."""
    p = run / "config.yaml"
    if not p.exists():
        raise ConfigError(f"{p} does not exist: pass a run directory written by digen train")
    return yaml.safe_load(p.read_text()) or {}


def is_follower_row(row: dict) -> bool:
    """A row a non-leader rank of a replica wrote about the replica's task (the leader's row,
    or the replica's own lane, stands for the task)."""
    ranks = row.get("ranks") or []
    return row.get("worker") in ranks[1:]
