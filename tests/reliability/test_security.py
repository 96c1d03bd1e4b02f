"""Security: Redis AUTH, ACL users and TLS URLs carry a job's queue (the embedded redis-server
started with a password); Dask TLS works with ``digen worker``; secrets stay out of reprs and
config.yaml. The no-pickle scan and the log scan of a whole run are in test_redis_restart.py."""

from __future__ import annotations

import operator
import select
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import yaml

from digen.controlplane.jobstate import JobState
from digen.controlplane.queue import TaskQueue
from digen.controlplane.redis_conn import SecretURL, connect, start_embedded, stop_embedded
from digen.controlplane.trainer_group import TrainerGroup
from digen.errors import ConnectionFailure

PASSWORD = "auth-Pw-7f3c-digen"


def make_certs(folder: Path, name: str = "digen-test"):
    """Temporary certificates (tests/reliability/certs.py; needs the ``cryptography`` package)."""
    pytest.importorskip("cryptography")
    from tests.reliability.certs import make_certs as make

    return make(folder, name)


BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def round_trip(r: redis.Redis, job: str) -> None:
    """What a job does with Redis: queue, lease, ack, results, the trainer group's keys."""
    q, state = TaskQueue(r, job, lease_s=30), JobState(r, job)
    q.put("gen", "gen:0:0", {"task": {"prompt": "a red square"}})
    leased = q.lease(["gen"], "w0")
    assert leased is not None and leased.payload == {"task": {"prompt": "a red square"}}
    assert q.ack(leased.task_id, {"rewards": [0.5]}, worker="w0")
    assert q.get_result("gen:0:0") == {"rewards": [0.5]}
    group = TrainerGroup(r, job)
    group.set_holding("t0", "127.0.0.1:1", [0], 0)
    assert group.holders_of(0) == ["127.0.0.1:1"]
    state.set_stepped(0)
    assert state.loop_state("w0", "token").stepped == 0
    q.clear()


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory) -> Iterator[int]:
    """The embedded redis-server with a password, also on TCP 127.0.0.1:<port>."""
    db, port = tmp_path_factory.mktemp("auth") / "auth.db", free_port()
    start_embedded(db, password=PASSWORD, port=port)
    yield port
    stop_embedded(db)


def test_redis_auth_url(auth_server: int):
    r = connect(f"redis://:{PASSWORD}@127.0.0.1:{auth_server}/0")
    round_trip(r, "auth-job")
    with pytest.raises(ConnectionFailure) as err:
        connect(f"redis://:not-the-Pw-123@127.0.0.1:{auth_server}/0")
    assert "wrong user or password" in str(err.value) and "not-the-Pw-123" not in str(err.value)
    with pytest.raises(ConnectionFailure, match="a password is required"):
        connect(f"redis://127.0.0.1:{auth_server}/0")


def test_redis_acl_user_limited_to_digen_keys(auth_server: int):
    admin = connect(f"redis://:{PASSWORD}@127.0.0.1:{auth_server}/0")
    admin.execute_command("ACL", "SETUSER", "digen-job", "reset", "on", ">user-Pw-91ab", "~digen:*", "+@all")
    r = connect(f"redis://digen-job:user-Pw-91ab@127.0.0.1:{auth_server}/0")
    round_trip(r, "acl-job")  # the queue's Lua scripts touch only digen:<job>:* keys
    with pytest.raises(redis.exceptions.NoPermissionError):
        r.set("not-a-digen-key", b"x")


class TlsTerminator:
    """A TLS front for a plain TCP Redis (as a managed Redis or stunnel would offer)."""

    def __init__(self, certs, upstream: int):
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.load_cert_chain(str(certs.cert), str(certs.key))
        self.upstream = upstream
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            tls = self.ctx.wrap_socket(conn, server_side=True)
        except (ssl.SSLError, OSError):
            conn.close()
            return
        up = socket.create_connection(("127.0.0.1", self.upstream))
        try:
            while True:
                ready = set(select.select([tls, up], [], [], 0.5)[0])
                if tls.pending():
                    ready.add(tls)
                for src in ready:
                    try:
                        data = src.recv(65536)
                    except ssl.SSLWantReadError:
                        continue
                    if not data:
                        return
                    (up if src is tls else tls).sendall(data)
        except OSError:
            return
        finally:
            up.close()
            tls.close()

    def close(self) -> None:
        self.sock.close()


def test_redis_tls_url(auth_server: int, tmp_path: Path):
    certs = make_certs(tmp_path / "tls")
    proxy = TlsTerminator(certs, auth_server)
    try:
        r = connect(f"rediss://:{PASSWORD}@127.0.0.1:{proxy.port}/0?ssl_ca_certs={certs.ca}")
        round_trip(r, "tls-job")
        r.close()
        other = make_certs(tmp_path / "other-ca", name="someone-else")
        with pytest.raises(ConnectionFailure) as err:
            connect(f"rediss://:{PASSWORD}@127.0.0.1:{proxy.port}/0?ssl_ca_certs={other.ca}", timeout_s=3)
        msg = str(err.value)
        assert "TLS error" in msg and "\n" not in msg and PASSWORD not in msg
    finally:
        proxy.close()


def test_rediss_with_the_clusters_ca_from_digen_certs(auth_server: int, tmp_path: Path):
    """The docker-compose Redis URL's shape: TLS checked against the CA of ``digen certs``
    (the Redis node's certificate on the server, only ``ca.pem`` on the client)."""
    pytest.importorskip("cryptography")
    from digen.cluster.certs import make_certs as digen_certs
    from digen.controlplane.redis_conn import check_redis_url
    from tests.reliability.certs import Certs

    redis_node, client_node = (f.folder for f in digen_certs(tmp_path / "certs", ["redis", "controller"]))
    proxy = TlsTerminator(
        Certs(redis_node / "ca.pem", redis_node / "cert.pem", redis_node / "key.pem"), auth_server
    )
    try:
        ca = client_node / "ca.pem"
        url = f"rediss://:{PASSWORD}@127.0.0.1:{proxy.port}/0?ssl_ca_certs={ca}&ssl_check_hostname=false"
        assert check_redis_url(url) is None
        r = connect(url)
        round_trip(r, "digen-certs-job")
        r.close()
    finally:
        proxy.close()


@pytest.mark.slow
def test_dask_tls_with_digen_worker(tmp_path: Path):
    from distributed import Client

    from digen.cluster.cluster import list_workers
    from digen.cluster.node import dask_security
    from digen.config import SecurityConfig

    certs = make_certs(tmp_path / "tls")
    sec_file = tmp_path / "security.yaml"
    sec_file.write_text(
        yaml.safe_dump(
            {"security": {"ca_file": str(certs.ca), "cert_file": str(certs.cert), "key_file": str(certs.key)}}
        )
    )
    port = free_port()
    address = f"tls://127.0.0.1:{port}"
    tls = ["--tls-ca-file", str(certs.ca), "--tls-cert", str(certs.cert), "--tls-key", str(certs.key)]
    procs = [
        subprocess.Popen(
            [
                str(BIN / "dask"),
                "scheduler",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--protocol",
                "tls",
                "--no-dashboard",
                *tls,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    ]
    try:
        deadline = time.monotonic() + 60
        while socket.socket().connect_ex(("127.0.0.1", port)) != 0:
            assert time.monotonic() < deadline, "the TLS scheduler did not start"
            time.sleep(0.2)
        procs.append(
            subprocess.Popen(
                [
                    str(BIN / "digen"),
                    "worker",
                    "--scheduler",
                    address,
                    "--role",
                    "trainer",
                    "--gpu-type",
                    "cpu",
                    "--name",
                    "tls-trainer",
                    "--security",
                    str(sec_file),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
        security = dask_security(
            SecurityConfig(ca_file=str(certs.ca), cert_file=str(certs.cert), key_file=str(certs.key)),
            "client",
        )
        with Client(address, security=security, timeout=30) as client:
            client.wait_for_workers(1, timeout=120)
            (w,) = list_workers(client)
            assert (w.name, w.role.value, w.gpu_type) == ("tls-trainer", "trainer", "cpu")
            assert w.address.startswith("tls://")
            assert (
                client.submit(operator.add, 40, 2, workers=[w.address], pure=False).result(timeout=60) == 42
            )
        with pytest.raises((OSError, TimeoutError)):  # no certificate, no entry
            Client(f"tcp://127.0.0.1:{port}", timeout=3)
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


def test_secret_url_repr_hides_the_password():
    url = SecretURL(f"redis://:{PASSWORD}@10.0.0.1:6379/0")
    assert str(url) == f"redis://:{PASSWORD}@10.0.0.1:6379/0"
    assert PASSWORD not in repr(url) and PASSWORD not in repr((url, "job"))  # Dask logs task args by repr
    assert "redis://:***@10.0.0.1:6379/0" in repr(url)


def test_config_yaml_never_holds_secret_values(small_config):
    from digen.config import dump_config

    cfg = small_config(
        reward=[
            {
                "name": "http",
                "kwargs": {
                    "url": "http://scorer:8765",
                    "api_key": "sk-live-123",
                    "headers": {"Authorization-Token": "tok-456"},
                },
            }
        ]
    )
    text = dump_config(cfg)
    assert "sk-live-123" not in text and "tok-456" not in text
    assert yaml.safe_load(text)["reward"][0]["kwargs"] == {
        "url": "http://scorer:8765",
        "api_key": "***",
        "headers": {"Authorization-Token": "***"},
    }
