"""The embedded local cluster: workers forked from the fork server see the environment the
controller has when it starts them, not the one the fork server started with (a spawned
worker would inherit it; fault hooks and DIGEN_HOME rely on that)."""

from __future__ import annotations

import os

import pytest

from digen.runtime.cluster import start_local_cluster


def worker_env(name: str) -> list[str | None]:
    cluster, client = start_local_cluster(1, 0, "cpu", 1, dashboard=False, start_method="forkserver")
    try:
        return list(client.run(lambda: os.environ.get(name)).values())
    finally:
        client.close()
        cluster.close()


@pytest.mark.slow
def test_forked_workers_see_variables_set_after_the_fork_server_started(monkeypatch):
    monkeypatch.delenv("DIGEN_TEST_MARK", raising=False)
    assert worker_env("DIGEN_TEST_MARK") == [None]  # the fork server is up from here on
    monkeypatch.setenv("DIGEN_TEST_MARK", "set-later")
    assert worker_env("DIGEN_TEST_MARK") == ["set-later"]
