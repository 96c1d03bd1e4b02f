"""TLS across hosts: a plain ``tcp://`` scheduler on another host is refused before anything
connects (exit 2, one line) unless ``--insecure`` (one warning line); ``digen certs`` makes a
CA and per-node files that Dask's TLS accepts; the embedded cluster honours ``security:``; a
worker's blob server takes its own node's files."""

from __future__ import annotations

import datetime as dt
import operator
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from digen.cli.main import app
from digen.cluster import node
from digen.config import Config
from digen.errors import ConfigError, ConnectionFailure
from tests.conftest import required

from .conftest import Namespace

DIGEN = str(Path(sys.executable).parent / "digen")
REMOTE = "tcp://198.51.100.7:8786"
"""A plain address of another host (TEST-NET-2): the refusals below send nothing to it."""


def digen(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([DIGEN, *args], capture_output=True, text=True, timeout=timeout)


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.3.4.5", True),
        ("localhost", True),
        ("::1", True),
        ("[::1]", True),
        ("::ffff:127.0.0.1", True),
        ("0.0.0.0", False),
        ("10.1.2.3", False),
        ("198.51.100.7", False),
    ],
)
def test_loopback_addresses(host: str, loopback: bool):
    assert node.is_loopback(host) is loopback


@pytest.mark.slow
def test_digen_worker_refuses_plain_tcp_to_another_host_in_one_line():
    res = digen("worker", "--scheduler", REMOTE, "--role", "rollout", "--gpu-type", "cpu")
    assert res.returncode == 2
    (line,) = lines(res.stderr + res.stdout)
    assert line.startswith("error:") and REMOTE in line
    assert "digen certs" in line and "--insecure" in line


@pytest.mark.parametrize(
    "args",
    [
        ["serve", "--scheduler", REMOTE, "--burst", "--burst-wait", "0"],
        ["train", "configs/quickstart.yaml", "--scheduler", REMOTE],
    ],
    ids=["serve", "train"],
)
def test_serve_and_train_refuse_it_too(args: list[str]):
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2, res.output
    (line,) = lines(res.output)
    assert "digen certs" in line and "--insecure" in line


@pytest.mark.slow
def test_insecure_goes_on_with_one_warning(netns: Namespace):
    """Nothing listens at the namespace's address: past the warning, the worker tries to
    connect and fails on that (exit 1), which the refusal above never reaches."""
    address = f"tcp://{netns.peer}:8786"
    res = digen("worker", "--scheduler", address, "--role", "rollout", "--gpu-type", "cpu", "--insecure")
    out = lines(res.stderr + res.stdout)
    assert res.returncode == 1, out
    warnings = [line for line in out if line.startswith("warning:")]
    assert len(warnings) == 1 and "--insecure" in warnings[0] and address in warnings[0]
    assert any(f"cannot reach the Dask scheduler at {address}" in line for line in out), out


@pytest.mark.slow
def test_a_loopback_scheduler_needs_no_insecure():
    res = digen("worker", "--scheduler", "tcp://127.0.0.1:1", "--role", "rollout", "--gpu-type", "cpu")
    assert res.returncode == 1 and "warning" not in res.stderr
    assert "cannot reach the Dask scheduler at tcp://127.0.0.1:1" in res.stderr


def test_a_worker_of_a_loopback_scheduler_listens_on_loopback():
    assert node.listen_host("tcp://127.0.0.1:8786") == "127.0.0.1"
    assert node.listen_host("tls://localhost:8786") == "127.0.0.1"


# ---------------------------------------------------------------------------------------------
# digen certs


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("certs") / "cluster"
    res = digen("certs", str(out), "--hosts", "head,worker-1", "--hosts", "10.0.0.5")
    assert res.returncode == 0, res.stderr
    return out


@pytest.mark.slow
def test_digen_certs_writes_a_ca_and_one_private_pair_per_node(certs: Path):
    from cryptography import x509

    assert sorted(p.name for p in certs.iterdir()) == ["10.0.0.5", "ca.key", "ca.pem", "head", "worker-1"]
    for path in certs.rglob("*"):
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))
    ca = x509.load_pem_x509_certificate((certs / "ca.pem").read_bytes())
    for name in ("head", "worker-1", "10.0.0.5"):
        folder = certs / name
        assert sorted(p.name for p in folder.iterdir()) == ["ca.pem", "cert.pem", "key.pem", "security.yaml"]
        cert = x509.load_pem_x509_certificate((folder / "cert.pem").read_bytes())
        cert.verify_directly_issued_by(ca)
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert name in [str(v.value) for v in san]
        assert cert.not_valid_after_utc - dt.datetime.now(dt.UTC) > dt.timedelta(days=360)
        sec = node.load_security(folder / "security.yaml")
        assert (sec.ca_file, sec.cert_file, sec.key_file) == tuple(
            str((folder / f).resolve()) for f in ("ca.pem", "cert.pem", "key.pem")
        )
    assert b"PRIVATE KEY" in (certs / "ca.key").read_bytes()


@pytest.mark.slow
def test_digen_certs_again_adds_nodes_and_keeps_the_rest(certs: Path, tmp_path: Path):
    before = {p: p.read_bytes() for p in certs.rglob("*") if p.is_file()}
    res = digen("certs", str(certs), "--hosts", "head,worker-2")
    assert res.returncode == 0, res.stderr
    assert "head: kept" in res.stderr and "worker-2: made" in res.stderr
    assert all(p.read_bytes() == data for p, data in before.items())  # nothing overwritten
    assert (certs / "worker-2" / "ca.pem").read_bytes() == (certs / "ca.pem").read_bytes()
    res = digen("certs", str(tmp_path / "x"), "--hosts", "bad/name")
    assert res.returncode == 2 and len(lines(res.stderr)) == 1


def _security(certs: Path, name: str):
    return node.dask_security(node.load_security(certs / name / "security.yaml"))


@pytest.mark.slow
def test_the_embedded_cluster_is_tls_with_the_nodes_certificates(certs: Path, tmp_path: Path):
    """The job's local cluster (the controller's own start-up path) with the config's
    ``security:`` section: every address is tls://; another node's certificate from the same
    CA gets in, a plain client or one from another CA does not; a worker's blob server takes
    its Dask worker's files, not the config's."""
    from distributed import Client

    from digen.cluster.cluster import close_local_cluster, list_workers
    from digen.runtime.controller import _local_cluster
    from digen.workers.context import node_tls

    head = node.load_security(certs / "head" / "security.yaml")
    one_scorer = {"rollout_workers": 0, "trainer_workers": 0, "reward_workers": 1, "start_method": "spawn"}
    cfg = Config.model_validate(  # a reward worker loads no model
        required({"cluster": {"local": one_scorer}, "security": head.model_dump()})
    )
    cluster, client = _local_cluster(cfg).result()
    try:
        assert cluster.scheduler_address.startswith("tls://127.0.0.1:")
        (w,) = list_workers(client)
        assert w.address.startswith("tls://127.0.0.1:")
        with Client(cluster.scheduler_address, security=_security(certs, "worker-1"), timeout=30) as other:
            assert other.submit(operator.add, 40, 2, workers=[w.address], pure=False).result(timeout=60) == 42
        other_ca = tmp_path / "other"
        assert digen("certs", str(other_ca), "--hosts", "head").returncode == 0
        with pytest.raises((OSError, TimeoutError)):
            Client(cluster.scheduler_address, security=_security(other_ca, "head"), timeout=3)
        # what digen worker and digen serve check before they start: the handshake, in one line
        node.check_reachable(
            cluster.scheduler_address, security=node.load_security(certs / "worker-1" / "security.yaml")
        )
        with pytest.raises(ConnectionFailure, match="same `digen certs` CA") as err:
            node.check_reachable(
                cluster.scheduler_address, security=node.load_security(other_ca / "head" / "security.yaml")
            )
        assert "\n" not in str(err.value)
        with pytest.raises((OSError, TimeoutError)):
            Client(cluster.scheduler_address.replace("tls://", "tcp://"), timeout=3)
        # a worker with its own files and a config naming the controller's: its own win
        theirs = Config.model_validate(
            required({"security": node.load_security(certs / "worker-1" / "security.yaml").model_dump()})
        )
        files = client.submit(node_tls, theirs, workers=[w.address], pure=False).result(timeout=60)
        assert files == (head.ca_file, head.cert_file, head.key_file)
    finally:
        client.close()
        close_local_cluster(cluster)


@pytest.mark.slow
def test_the_embedded_cluster_without_a_security_section_is_tls_with_the_jobs_own_files(
    certs: Path, tmp_path: Path
):
    """No ``security:`` section (the default): the local cluster is mutual TLS with a CA made
    for the job, its files in a 0700 folder, each 0600, gone once the cluster closes. A plain
    client is refused, and so is one with a certificate of another CA (``certs``), and
    ``digen worker`` given its address as ``tcp://`` says in one line that it speaks TLS; a
    worker added mid-job joins over the same TLS, and its blob server takes the job's files."""
    from distributed import Client

    from digen.cluster.cluster import add_local_worker, list_workers
    from digen.runtime.controller import _local_cluster
    from digen.workers.context import node_tls

    one_scorer = {"rollout_workers": 0, "trainer_workers": 0, "reward_workers": 1, "start_method": "spawn"}
    cfg = Config.model_validate(required({"cluster": {"local": one_scorer}}))
    assert not cfg.security.enabled
    starting = _local_cluster(cfg)
    cluster, client = starting.result()
    folder = starting._certs.folder
    try:
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        assert sorted(p.name for p in folder.iterdir()) == ["ca.pem", "cert.pem", "key.pem"]  # no CA key
        assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in folder.iterdir())
        assert cluster.scheduler_address.startswith("tls://127.0.0.1:")
        with pytest.raises((OSError, TimeoutError)):
            Client(cluster.scheduler_address.replace("tls://", "tcp://"), timeout=3)
        with pytest.raises((OSError, TimeoutError)):
            Client(cluster.scheduler_address, security=_security(certs, "head"), timeout=3)
        # a tcp:// address for it: one line naming TLS, not Dask's "Nanny failed to start"
        plain = cluster.scheduler_address.replace("tls://", "tcp://")
        with pytest.raises(ConfigError, match="speaks TLS"):
            node.check_reachable(plain)
        res = digen("worker", "--scheduler", plain, "--role", "reward", "--gpu-type", "cpu", "--insecure")
        assert res.returncode == 2, res.stderr
        (line,) = lines(res.stderr + res.stdout)
        assert "speaks TLS" in line and plain.replace("tcp://", "tls://") in line and "--security" in line
        name = add_local_worker(cluster, "reward", "cpu")
        client.wait_for_workers(2, timeout=120)
        workers = {w.name: w for w in list_workers(client)}
        assert sorted(workers) == ["reward-0", name] and all(
            w.address.startswith("tls://127.0.0.1:") for w in workers.values()
        )
        files = client.submit(node_tls, cfg, workers=[workers[name].address], pure=False).result(timeout=60)
        assert files == starting._certs.files
    finally:
        client.close()
        starting.close()
    assert not folder.exists()


def test_a_killed_jobs_tls_folder_is_removed_by_the_next_job_and_a_live_ones_kept(tmp_path: Path):
    import os

    from digen.cluster.certs import JobCerts

    dead = subprocess.Popen(["true"])
    dead.wait()
    leftover = tmp_path / f"digen-tls-{dead.pid}-x1"
    live = tmp_path / f"digen-tls-{os.getpid()}-x2"
    other = tmp_path / "digen-tls-notapid-x3"
    for folder in (leftover, live, other):
        folder.mkdir(mode=0o700)
        (folder / "key.pem").write_bytes(b"k")
    made = JobCerts.make(str(tmp_path))
    try:
        assert not leftover.exists() and live.exists() and other.exists()
        assert made.folder.name.startswith(f"digen-tls-{os.getpid()}-") and made.folder.parent == tmp_path
    finally:
        made.remove()
    assert not made.folder.exists()
