"""The embedded local cluster: workers forked from the fork server see the environment the
controller has when it starts them, not the one the fork server started with (a spawned
worker would inherit it; fault hooks and DIGEN_HOME rely on that); they start with the
families' pipeline code imported and the fork server's objects frozen (digen.workers.forkserver)."""

from __future__ import annotations

import gc
import os
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from digen.cluster.cluster import start_local_cluster


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


def parallel_matmul() -> float:
    """A two-thread torch op. Run by ``client.run`` (on a worker's main thread, the thread the
    fork server forked it on) it hangs when the server was forked from a process whose main
    thread had run an OpenMP op (seen here: a worker thread, as ``client.submit`` uses, starts
    a pool of its own and does not hang)."""
    import torch

    torch.set_num_threads(2)
    a = torch.ones(512, 512)
    return float((a @ a).sum())


def worker_logging() -> tuple[int, list[str]]:
    """(root handlers, the ``distributed`` logger's handler classes) in a worker."""
    import logging

    return len(logging.getLogger().handlers), [
        type(h).__name__ for h in logging.getLogger("distributed").handlers
    ]


@pytest.mark.slow
def test_the_fork_server_is_a_fork_of_this_process_and_its_workers_compute():
    """The session forked the server from this process (tests/conftest.py), as ``digen train``
    does: its parent is this process and its command line is this one's (a spawned server runs
    ``-c 'from multiprocessing.forkserver import main...'``); a worker forked from it runs a
    multi-threaded op, even though this process has computed since, and starts with Dask's
    log set up as in a new process (none of this process's handlers)."""
    import multiprocessing.forkserver as mpfs

    import psutil

    pid = mpfs._forkserver._forkserver_pid
    assert pid is not None
    server = psutil.Process(pid)
    assert server.ppid() == os.getpid()
    assert server.cmdline() == psutil.Process().cmdline()
    parallel_matmul()  # this process's OpenMP pool runs now; the server was forked before
    cluster, client = start_local_cluster(1, 0, "cpu", 2, dashboard=False, start_method="forkserver")
    try:
        on_main_thread = ThreadPoolExecutor(1).submit(client.run, parallel_matmul)
        assert list(on_main_thread.result(timeout=120).values()) == [512.0**3]  # no hang
        roots, dask_handlers = client.submit(worker_logging, pure=False).result(timeout=60)
        assert roots == 0 and dask_handlers == ["StreamHandler"]
        [worker_pid] = client.run(os.getpid).values()
        assert psutil.Process(worker_pid).ppid() == pid
    finally:
        client.close()
        cluster.close()


@pytest.mark.parametrize(
    "before",
    [
        "import threading, time; threading.Thread(target=time.sleep, args=(30,), daemon=True).start()",
        "import onnxruntime",
        "",
    ],
    ids=["a-thread-runs", "onnxruntime-loaded", "nothing"],
)
@pytest.mark.slow
def test_the_server_is_forked_only_from_a_process_with_no_thread_pool(before):
    """A fork copies the forking thread alone, with every lock other threads held: with a
    second thread running or onnxruntime's pools loaded, prefork_server forks nothing (the
    spawned server is used); from a fresh process it forks. In a fresh interpreter: this
    session's server is already running."""
    import subprocess

    if "onnxruntime" in before:
        pytest.importorskip("onnxruntime")
    code = f"{before}\nfrom digen.cluster.cluster import prefork_server\nprint(prefork_server())"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    got = out.stdout.strip().splitlines()[-1]
    assert (got == "None") == bool(before), out.stdout + out.stderr
    if not before:
        assert int(got) > 0


@pytest.mark.slow
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


def test_the_forked_server_keeps_no_log_handler_that_writes_to_a_descriptor_it_closes(tmp_path):
    """A log handler the parent left on any logger (a test runner's file handler that torch
    copied onto its own loggers) would write into whatever reuses its descriptor in the server
    and the workers it forks: once, the fork server's alive pipe, and the server exited. The
    server drops such handlers; one that wrote to a stream writes to stderr instead."""
    import logging
    import os
    import sys

    from digen.workers.forkserver import _drop_parent_handlers

    r, w = os.pipe()
    lg = logging.getLogger("digen.test.forked")
    to_file = logging.FileHandler(tmp_path / "runner.log")
    to_pipe = logging.StreamHandler(os.fdopen(w, "w"))
    to_pipe.setLevel(logging.ERROR)
    to_stderr = logging.StreamHandler(sys.__stderr__)
    lg.handlers = [to_file, to_pipe, to_stderr]
    try:
        _drop_parent_handlers(lg)
        assert to_file not in lg.handlers and to_pipe not in lg.handlers and to_stderr in lg.handlers
        twin = [h for h in lg.handlers if h is not to_stderr]
        assert len(twin) == 1 and twin[0].stream.fileno() == 2 and twin[0].level == logging.ERROR
    finally:
        lg.handlers = []
        to_file.close()
        to_pipe.stream.close()
        os.close(r)
