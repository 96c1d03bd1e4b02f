"""digen worker and Dask TLS: device pinning, names, input errors, an unreachable scheduler,
the security: section, and a real TLS scheduler joined by a digen worker."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from digen.cli.main import app
from digen.cluster import node
from digen.config import SecurityConfig, build_config
from digen.errors import ConfigError, ConnectionFailure
from tests.conftest import required
from tests.processes import Procs, wait_for

DASK = str(Path(sys.executable).parent / "dask")


def cli(*args: object):
    return CliRunner().invoke(app, [str(a) for a in args])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    ("device", "env"),
    [
        (None, {}),
        ("cpu", {"CUDA_VISIBLE_DEVICES": "", "DIGEN_DEVICE": "cpu"}),
        ("cuda", {"CUDA_VISIBLE_DEVICES": "0", "DIGEN_DEVICE": "cuda:0"}),
        ("cuda:3", {"CUDA_VISIBLE_DEVICES": "3", "DIGEN_DEVICE": "cuda:0"}),
    ],
)
def test_device_pins_the_worker_process_to_one_gpu(device, env):
    assert node.device_env(device) == env


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "mps:0"])
def test_bad_device_is_bad_input(device):
    with pytest.raises(ConfigError, match="--device"):
        node.device_env(device)


def test_worker_names_are_unique_and_say_role_and_gpu():
    a, b = node.worker_name("trainer", "a100"), node.worker_name("trainer", "a100")
    assert a != b and a.startswith("trainer-a100-") and b.startswith("trainer-a100-")


def test_unreachable_scheduler_fails_at_once_naming_the_address():
    addr = f"tcp://127.0.0.1:{free_port()}"
    # refused, not timed out: it answered the first connection attempt
    with pytest.raises(
        ConnectionFailure, match=rf"cannot reach the Dask scheduler at {addr} \(Connection refused\)"
    ):
        node.check_reachable(addr)
    res = cli("worker", "--scheduler", addr, "--role", "rollout", "--gpu-type", "h100")
    assert res.exit_code == 1 and f"cannot reach the Dask scheduler at {addr}" in res.output
    res = cli("serve", "--scheduler", addr, "--burst", "--burst-wait", "0")
    assert res.exit_code == 1 and f"cannot reach the Dask scheduler at {addr}" in res.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--role", "critic", "--gpu-type", "h100"], "--role (critic) must be rollout, trainer or reward"),
        (["--role", "rollout", "--gpu-type", "h 100"], "--gpu-type"),
        (["--role", "rollout", "--gpu-type", "h100", "--device", "gpu0"], "--device (gpu0)"),
        (["--role", "rollout", "--gpu-type", "h100", "--nthreads", "0"], "--nthreads (0)"),
    ],
)
def test_worker_bad_input_exits_2(args, message):
    res = cli("worker", "--scheduler", "tcp://127.0.0.1:1", *args)
    assert res.exit_code == 2 and message in res.output


def test_tls_scheduler_needs_certificates():
    res = cli("worker", "--scheduler", "tls://127.0.0.1:1", "--role", "rollout", "--gpu-type", "h100")
    assert res.exit_code == 2 and "--security" in res.output


def make_certs(folder: Path) -> dict[str, Path]:
    """A CA and one node certificate signed by it, made with openssl (digen certs is not the only way)."""

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)

    folder.mkdir(parents=True, exist_ok=True)
    run(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=digen-ca",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
    )
    run(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=digen-node",
        "-keyout",
        "node.key",
        "-out",
        "node.csr",
    )
    run(
        "x509",
        "-req",
        "-in",
        "node.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-out",
        "node.pem",
    )
    return {"ca_file": folder / "ca.pem", "cert_file": folder / "node.pem", "key_file": folder / "node.key"}


def test_security_section_paths_resolve_against_its_file(tmp_path: Path):
    for name in ("ca.pem", "node.pem", "node.key"):
        (tmp_path / "certs" / name).parent.mkdir(exist_ok=True)
        (tmp_path / "certs" / name).write_text("x")
    cfg = tmp_path / "job.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "iterations": 3,
                "security": {
                    "ca_file": "certs/ca.pem",
                    "cert_file": "certs/node.pem",
                    "key_file": "certs/node.key",
                },
            }
        )
    )
    sec = node.load_security(cfg)  # a job config works: only its security: section is read
    assert sec.ca_file == str((tmp_path / "certs/ca.pem").resolve()) and sec.require_encryption
    worker = node.dask_security(sec, "worker")
    assert (worker.tls_ca_file, worker.tls_worker_cert, worker.tls_worker_key) == (
        sec.ca_file,
        sec.cert_file,
        sec.key_file,
    )
    client = node.dask_security(sec, "client")
    assert (client.tls_client_cert, client.tls_client_key) == (sec.cert_file, sec.key_file)
    assert node.dask_tls_config(sec)["distributed.comm.tls.client.cert"] == sec.cert_file
    assert (
        node.dask_security(SecurityConfig(), "worker") is None
        and node.dask_tls_config(SecurityConfig()) == {}
    )

    (tmp_path / "certs" / "node.key").unlink()
    with pytest.raises(ConfigError, match=r"security.key_file \(certs/node.key\) does not exist"):
        node.load_security(cfg)


def test_config_security_section_reports_every_problem(tiny_sd3: Path, tmp_path: Path):
    data = required({"model": {"path": str(tiny_sd3)}, "security": {"ca_file": str(tmp_path / "nope.pem")}})
    with pytest.raises(ConfigError) as err:
        build_config(data)
    problems = "\n".join(err.value.problems)
    assert "security.ca_file" in problems and "does not exist" in problems
    assert "security.cert_file is missing" in problems and "security.key_file is missing" in problems


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_digen_worker_joins_a_tls_scheduler(tmp_path: Path, digen_home: Path):
    """The scheduler, a digen worker (--security) and the controller's client path (dask
    config from the job's security: section) all on TLS; a client without certificates is
    refused."""
    import dask
    import distributed  # noqa: F401 - its config defaults must exist before dask.config.set

    from digen.cluster.cluster import connect_scheduler, list_workers

    certs = make_certs(tmp_path / "certs")
    sec_file = tmp_path / "security.yaml"
    sec_file.write_text(yaml.safe_dump({"security": {k: str(v) for k, v in certs.items()}}))
    info = tmp_path / "scheduler.json"
    procs = Procs(digen_home, tmp_path)
    try:
        procs.start(
            DASK,
            "scheduler",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--protocol",
            "tls",
            "--no-dashboard",
            "--tls-ca-file",
            str(certs["ca_file"]),
            "--tls-cert",
            str(certs["cert_file"]),
            "--tls-key",
            str(certs["key_file"]),
            "--scheduler-file",
            str(info),
            name="scheduler",
        )
        wait_for(lambda: info.exists() and info.stat().st_size > 0, 60, "the TLS scheduler")
        address = json.loads(info.read_text())["address"]
        assert address.startswith("tls://")
        w = procs.digen(
            "worker",
            "--scheduler",
            address,
            "--role",
            "trainer",
            "--gpu-type",
            "tls",
            "--name",
            "trainer-tls",
            "--security",
            str(sec_file),
            name="worker",
        )
        wait_for(lambda: "joined" in procs.output(w), 90, "the worker to join over TLS")

        sec = node.load_security(sec_file)
        with dask.config.set(node.dask_tls_config(sec)):  # what the job runner does for the controller
            client = connect_scheduler(address)
        try:
            workers = list_workers(client)
        finally:
            client.close()
        assert [(x.name, x.role.value, x.gpu_type) for x in workers] == [("trainer-tls", "trainer", "tls")]
        assert workers[0].address.startswith("tls://")

        rogue = {k: str(v) for k, v in make_certs(tmp_path / "rogue").items()}  # signed by another CA
        with dask.config.set(node.dask_tls_config(SecurityConfig(**rogue))):
            with pytest.raises(ConnectionFailure, match=f"cannot reach the Dask scheduler at {address}"):
                connect_scheduler(address, timeout_s=3)
    finally:
        procs.stop_all()
