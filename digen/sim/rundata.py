"""A run directory as the simulator reads it (:mod:`digen.sim.calibrate`,
:mod:`digen.sim.sp_calibration`): ``config.yaml`` and the JSONL files that ``digen train``
wrote (:mod:`digen.rundir`), a missing file being a :class:`~digen.errors.ConfigError` that
names it, and which timeline rows stand for a task.
"""

from __future__ import annotations

from pathlib import Path

from digen.errors import ConfigError
from digen.rundir import _read_jsonl
from digen.sim.files import read_mapping

RUN_DIR = "pass a run directory written by digen train"


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a run's JSONL file (up to a line cut by a crash)."""
    if not path.exists():
        raise ConfigError(f"{path} does not exist: {RUN_DIR}")
    return _read_jsonl(path)


def read_config(run: Path) -> dict:
    """The run's ``config.yaml`` as a dict (resolved, as the run wrote it)."""
    return read_mapping(run / "config.yaml", RUN_DIR)


def is_follower_row(row: dict) -> bool:
    """A row a non-leader rank of a replica wrote about the replica's task (the leader's row,
    or the replica's own lane, stands for the task)."""
    ranks = row.get("ranks") or []
    return row.get("worker") in ranks[1:]
