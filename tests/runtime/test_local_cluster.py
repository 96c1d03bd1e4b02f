"""The embedded local cluster: workers forked from the fork server see the environment the
controller has when it starts them, not the one the fork server started with (a spawned
worker would inherit it; fault hooks and DIGEN_HOME rely on that); they start with the
families' pipeline code imported and the fork server's objects frozen (workers.forkserver)."""

from __future__ import annotations

import gc
import os
import sys
import urllib.error
import urllib.request

import pytest

from digen.runtime.cluster import start_local_cluster


def on_worker(fn) -> list:
    """``fn()`` run in the one worker of a fresh forked local cluster."""
    cluster, client = start_local_cluster(1, 0, "cpu", 1, dashboard=False, start_method="forkserver")
    try:
        return list(client.run(fn).values())
    finally:
        client.close()
        cluster.close()


def worker_env(name: str) -> list[str | None]:
    return on_worker(lambda: os.environ.get(name))


def forked_state() -> tuple[int, bool, bool]:
    """(objects frozen, SD3 pipeline module imported, Wan pipeline module imported) in a worker
    that has loaded no policy yet."""
    mods = sys.modules
    return (
        gc.get_freeze_count(),
        "diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3" in mods,
        "diffusers.pipelines.wan.pipeline_wan" in mods,
    )


@pytest.mark.slow
def test_forked_workers_see_variables_set_after_the_fork_server_started(monkeypatch):
    monkeypatch.delenv("DIGEN_TEST_MARK", raising=False)
    assert worker_env("DIGEN_TEST_MARK") == [None]  # the fork server is up from here on
    monkeypatch.setenv("DIGEN_TEST_MARK", "set-later")
    assert worker_env("DIGEN_TEST_MARK") == ["set-later"]


@pytest.mark.slow
def test_forked_workers_start_with_the_pipeline_code_imported_and_frozen():
    [(frozen, sd3, wan)] = on_worker(forked_state)
    assert sd3 and wan  # imported by the fork server, before any policy load
    assert frozen > 10_000  # the fork server's imports sit in the permanent generation


def test_the_local_cluster_serves_no_dashboard_unless_asked():
    """The default local cluster (config and function) connects no bokeh dashboard to the
    scheduler (Dask still serves its plain HTTP routes, so the start notice leaves the link
    out by the config, not by the link)."""
    from digen.config import LocalClusterConfig

    assert LocalClusterConfig().dashboard is False
    cluster, client = start_local_cluster(1, 0, "cpu", 1, start_method="forkserver")
    try:
        port = client.scheduler_info()["services"]["dashboard"]
        with pytest.raises(urllib.error.HTTPError) as got:  # bokeh's page, missing
            urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=30)
        assert got.value.code == 404
    finally:
        client.close()
        cluster.close()
