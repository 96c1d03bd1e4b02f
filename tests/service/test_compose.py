"""docker-compose.yml, .env.example and the Dockerfile: valid YAML, every service command a real
command that accepts its flags, Redis secured and persistent, GPU reservations well-formed,
a cpu profile that needs no GPU."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

from digen.cli.main import app
from tests.processes import ROOT

COMPOSE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = ROOT / ".env.example"
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")


def env_example() -> dict[str, str]:
    out = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def interpolate(value, env: dict[str, str]):
    """Compose's ${VAR}, ${VAR:-default}, ${VAR:?error} and $$, as `docker compose config` does."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        if name in env and (env[name] != "" or op != ":-"):
            return env[name]
        if op in (":-", "-"):
            return arg
        if op in (":?", "?"):
            raise AssertionError(f"${{{name}}} is required ({arg}) but .env.example does not set it")
        return ""

    return _VAR.sub(sub, value.replace("$$", "\0")).replace("\0", "$")


@pytest.fixture(scope="module")
def compose() -> dict:
    return interpolate(yaml.safe_load(COMPOSE.read_text()), env_example())


def services(compose: dict, profile: str | None = None) -> dict[str, dict]:
    """The services ``docker compose --profile PROFILE up`` starts (all when None)."""
    return {
        name: s
        for name, s in compose["services"].items()
        if profile is None or not s.get("profiles") or profile in s["profiles"]
    }


def gpu_devices(service: dict) -> list[dict]:
    return (service.get("deploy", {}).get("resources", {}).get("reservations", {}) or {}).get(
        "devices", []
    ) or []


def digen_command(args: list[str]):
    """Parse ``digen SUB ARGS`` with the real CLI (no run); raises a UsageError on a bad flag."""
    group = typer.main.get_command(app)
    sub = group.commands.get(args[1])  # type: ignore[attr-defined]
    assert sub is not None, f"digen has no command {args[1]!r}"
    with sub.make_context(f"digen {args[1]}", list(args[2:]), resilient_parsing=False):
        pass
    return sub


def test_compose_has_the_stack_and_env_example_sets_what_it_needs(compose: dict):
    assert {"certs", "redis", "scheduler", "controller", "worker", "rollout-cpu", "trainer-cpu"} <= set(
        compose["services"]
    )
    env = env_example()
    assert env["REDIS_PASSWORD"] and env["COMPOSE_PROFILES"] in ("gpu", "cpu")


def test_every_service_command_is_a_real_command_that_accepts_its_flags(compose: dict, tmp_path: Path):
    from distributed.cli.dask_scheduler import main as dask_scheduler

    for file in ("ca.pem", "cert.pem", "key.pem"):  # the scheduler's parser wants its TLS files to exist
        (tmp_path / file).touch()

    seen = set()
    for name, s in compose["services"].items():
        cmd = s["command"]
        assert isinstance(cmd, list) and cmd, name
        if cmd[0] == "digen":
            digen_command(cmd)
            res = CliRunner().invoke(app, [cmd[1], "--help"])
            assert res.exit_code == 0, (name, res.output)
            seen.add(cmd[1])
        elif cmd[:2] == ["dask", "scheduler"]:
            args = [a.replace("/etc/digen/tls", str(tmp_path)) for a in cmd[2:]]
            with dask_scheduler.make_context("dask scheduler", args):
                pass
            seen.add("dask scheduler")
        else:
            assert name == "redis" and "redis-server" in cmd[-1], name
    assert seen == {"certs", "serve", "worker", "dask scheduler"}


def test_the_command_parser_check_catches_a_bad_flag():
    from typer._click.exceptions import UsageError

    with pytest.raises(UsageError, match="--rol"):
        digen_command(["digen", "worker", "--scheduler", "tcp://s:8786", "--rol", "rollout"])


def test_redis_has_a_password_from_env_aof_and_a_healthcheck(compose: dict):
    raw = yaml.safe_load(COMPOSE.read_text())["services"]["redis"]
    assert "${REDIS_PASSWORD" in raw["environment"]["REDIS_PASSWORD"]  # from .env, never a literal
    line = compose["services"]["redis"]["command"][-1]
    assert '--requirepass "$REDIS_PASSWORD"' in line and "--appendonly yes" in line
    assert "ping" in " ".join(compose["services"]["redis"]["healthcheck"]["test"])
    url = compose["services"]["controller"]["environment"]["DIGEN_REDIS_URL"]
    assert url == (
        f"rediss://:{env_example()['REDIS_PASSWORD']}@redis:6379/0"
        f"?ssl_ca_certs={TLS_DIR}/ca.pem&ssl_check_hostname=false"
    )
    deps = compose["services"]["controller"]["depends_on"]
    assert deps["redis"]["condition"] == "service_healthy"


def test_one_gpu_worker_service_takes_every_gpu_of_its_node(compose: dict):
    """One service per node: all its GPUs reserved, one worker process per GPU (--gpus auto),
    the types read from the GPUs' names, the roles split by counts."""
    from digen.cluster.placement import parse_roles

    gpu = {n: s for n, s in compose["services"].items() if gpu_devices(s)}
    assert set(gpu) == {"worker"}
    s = gpu["worker"]
    assert s["profiles"] == ["gpu"]
    (dev,) = gpu_devices(s)
    assert dev["driver"] == "nvidia" and "gpu" in dev["capabilities"] and dev["count"] == "all"
    assert "device_ids" not in dev
    cmd = s["command"]
    assert cmd[cmd.index("--gpus") + 1] == "auto" and "--device" not in cmd and "--gpu-type" not in cmd
    assert parse_roles(cmd[cmd.index("--role") + 1], 8) == ["trainer"] + ["rollout"] * 7
    # NCCL's shared memory: more than Docker's 64 MB /dev/shm (or the host's IPC namespace)
    shm = str(s.get("shm_size", "64m")).lower()
    assert s.get("ipc") == "host" or (shm.endswith("gb") and int(shm[:-2]) >= 1), s


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_each_profile_runs_the_whole_stack(compose: dict, profile: str):
    active = services(compose, profile)
    roles = {
        r.partition("=")[0]
        for s in active.values()
        if "worker" in s["command"]
        for r in s["command"][s["command"].index("--role") + 1].split(",")
    }
    assert {"certs", "redis", "scheduler", "controller"} <= set(active) and roles == {"rollout", "trainer"}


TLS_DIR = "/etc/digen/tls"


def own_certs_mount(service: dict) -> dict | None:
    """The service's mount of the certs volume (None without one)."""
    mounts = [m for m in service.get("volumes", []) if isinstance(m, dict) and m.get("source") == "certs"]
    assert len(mounts) <= 1
    return mounts[0] if mounts else None


def test_dask_is_tls_and_each_service_mounts_only_its_own_certificate(compose: dict):
    """The default path is TLS: the scheduler listens on tls:// with its own files, every digen
    service reaches it at tls:// with --security (no --insecure anywhere), and each mounts
    only its own folder of the certs volume, which the one-shot certs service fills (with a
    certificate for each of them) before any of them starts."""
    certs = compose["services"]["certs"]
    cmd = certs["command"]
    assert cmd[:3] == ["digen", "certs", "/certs"] and certs["restart"] == "no"
    hosts = set(cmd[cmd.index("--hosts") + 1].split(","))
    assert certs["volumes"] == ["certs:/certs"]
    assert "certs" in yaml.safe_load(COMPOSE.read_text())["volumes"]
    dask_services = set()
    for name, s in compose["services"].items():
        cmd = s["command"]
        assert "--insecure" not in cmd, name
        assert not any(str(a).startswith("tcp://") for a in cmd), (name, cmd)
        if name == "certs":
            continue
        if name == "redis":  # TLS only, with its own certificate
            mount = own_certs_mount(s)
            assert mount is not None and mount["volume"]["subpath"] == "redis" and mount["read_only"]
            line = cmd[-1]
            assert "--port 0 --tls-port 6379" in line and "redis" in hosts
            for flag, file in (("--tls-cert-file", "cert.pem"), ("--tls-key-file", "key.pem")):
                assert f"{flag} {TLS_DIR}/{file}" in line
            assert f"--tls --cacert {TLS_DIR}/ca.pem" in " ".join(s["healthcheck"]["test"])
            continue
        dask_services.add(name)
        mount = own_certs_mount(s)
        assert mount is not None, f"{name} mounts no certificate"
        assert mount["target"] == TLS_DIR and mount["read_only"] is True
        assert mount["volume"]["subpath"] == name, f"{name} mounts another service's files"
        assert s["depends_on"]["certs"]["condition"] == "service_completed_successfully", name
        if cmd[:2] == ["dask", "scheduler"]:
            assert cmd[cmd.index("--protocol") + 1] == "tls"
            probe = " ".join(s["healthcheck"]["test"])  # HTTP: a bare probe of the TLS port logs a failure
            assert "http://localhost:8787/health" in probe and "8786" not in probe
            for flag, file in (
                ("--tls-ca-file", "ca.pem"),
                ("--tls-cert", "cert.pem"),
                ("--tls-key", "key.pem"),
            ):
                assert cmd[cmd.index(flag) + 1] == f"{TLS_DIR}/{file}", (name, flag)
        else:
            assert cmd[cmd.index("--scheduler") + 1] == "tls://scheduler:8786", name
            assert cmd[cmd.index("--security") + 1] == f"{TLS_DIR}/security.yaml", name
    assert dask_services | {"redis"} == hosts, (
        "digen certs makes a certificate for exactly the services that mount one"
    )


def test_the_certs_service_makes_what_the_services_mount(tmp_path):
    """Run the certs service's command here: each service's folder holds the files its
    command names (the security.yaml one of them loads)."""
    from digen.cluster.node import load_security

    compose = yaml.safe_load(COMPOSE.read_text())
    cmd = compose["services"]["certs"]["command"]
    res = CliRunner().invoke(app, [cmd[1], str(tmp_path / "certs"), *cmd[3:]])
    assert res.exit_code == 0, res.output
    for name in cmd[cmd.index("--hosts") + 1].split(","):
        folder = tmp_path / "certs" / name
        assert {p.name for p in folder.iterdir()} == {"ca.pem", "cert.pem", "key.pem", "security.yaml"}
        sec = load_security(folder / "security.yaml")
        assert Path(sec.cert_file) == (folder / "cert.pem").resolve()


def test_the_cpu_profile_needs_no_gpu(compose: dict):
    for name, s in services(compose, "cpu").items():
        assert not gpu_devices(s), name
        assert "gpus" not in s and s.get("runtime") != "nvidia", name
        cmd = s["command"]
        if "worker" in cmd:
            assert cmd[cmd.index("--device") + 1] == "cpu" and cmd[cmd.index("--gpu-type") + 1] == "cpu"


def test_dockerfile_builds_the_package_with_a_selectable_torch():
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11", text, re.M)
    assert "ARG TORCH_INDEX_URL" in text and "pip install -e ." in text
    for folder in ("digen", "workers", "cli", "configs", "assets"):
        assert f"COPY {folder} {folder}" in text
    build = yaml.safe_load(COMPOSE.read_text())["x-digen"]["build"]
    assert build["context"] == "." and "TORCH_INDEX_URL" in build["args"]


@pytest.mark.slow  # runs docker compose
@pytest.mark.skipif(shutil.which("docker") is None, reason="needs docker")
@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_docker_compose_config_accepts_the_file(profile: str):
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip("docker compose plugin not installed")
    res = subprocess.run(
        ["docker", "compose", "--env-file", str(ENV_EXAMPLE), "--profile", profile, "config", "--quiet"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
