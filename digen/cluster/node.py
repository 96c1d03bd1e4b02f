"""A digen worker node: one Dask worker (under a Nanny) that carries a role and a GPU type.

``digen worker --scheduler ADDR --role trainer --gpu-type a100`` starts one. Its Dask
resources are ``{"trainer": 1, "gpu-a100": 1}`` (:func:`~digen.controlplane.resources.worker_resources`),
so the controller of a running job sees it within half a second and gives it a worker loop at
the next iteration boundary. ``--device cuda:N`` pins it to GPU N: the worker process sees
only that GPU (``CUDA_VISIBLE_DEVICES=N``) and the worker loop runs on ``cuda:0``
(``DIGEN_DEVICE``). ``--gpus auto`` (or ``--gpus 0,1,2,3``) starts one worker process per GPU
of the node instead, each pinned to its GPU and tagged with its type as the local cluster's
workers are (:mod:`digen.cluster.placement`); ``--role trainer=2,rollout`` splits the roles
(trainers on adjacent GPUs first), ``--role rollout`` gives every GPU the one role.

Where it listens: on the address that routes to the scheduler (:func:`listen_host`), so a
worker of a scheduler on this host (``tcp://127.0.0.1:8786``) listens on loopback only, and
one of a remote scheduler on the interface facing it, never on every interface. ``--host``
overrides it.

TLS (``tls://`` addresses): a node's ``security:`` section names the cluster's CA, the
node's own certificate and key (PEM; ``digen certs`` makes them). :func:`dask_security` turns
it into a ``distributed.Security`` whose every side (client, worker, scheduler) shows that
certificate; :func:`dask_tls_config` into the dask config keys that a ``Client`` created
without an explicit ``security`` reads. A plain ``tcp://`` address of another host is refused
before anything connects (:func:`check_scheduler_address`): anyone who reaches a plain Dask
scheduler or worker runs code in it. ``--insecure`` lets it through with a warning, for a
network isolated otherwise.
"""

from __future__ import annotations

import logging
import socket
import ssl
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from digen.cluster.placement import Placement, discover, parse_gpu_ids, parse_roles, place
from digen.config import SecurityConfig, read_yaml
from digen.controlplane.redis_conn import is_loopback
from digen.controlplane.resources import worker_resources
from digen.errors import ConfigError, ConnectionFailure

log = logging.getLogger(__name__)

ROLES = ("rollout", "trainer", "reward")


def worker_name(role: str, gpu_type: str) -> str:
    """A cluster-unique default name: ``<role>-<gpu type>-<host>-<6 hex>``."""
    host = socket.gethostname().split(".")[0] or "host"
    return f"{role}-{gpu_type}-{host}-{uuid.uuid4().hex[:6]}"


def device_env(device: str | None) -> dict[str, str]:
    """Environment of the worker process for ``--device``: ``cuda:N`` -> only GPU N visible,
    used as ``cuda:0``; ``cpu`` -> no GPU; None -> the config's ``model.device``."""
    if device is None:
        return {}
    if device == "cpu":
        return {"CUDA_VISIBLE_DEVICES": "", "DIGEN_DEVICE": "cpu"}
    kind, _, index = device.partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        raise ConfigError(f"--device ({device}) must be cpu, cuda or cuda:N (N a GPU index, e.g. cuda:1)")
    return {"CUDA_VISIBLE_DEVICES": index or "0", "DIGEN_DEVICE": "cuda:0"}


LOOPBACK = "127.0.0.1"


def split_address(address: str, flag: str = "--scheduler") -> tuple[str, str, int]:
    """``(scheme, host, port)`` of a Dask address (``tcp://`` when it names none)."""
    parts = urlsplit(address if "://" in address else f"tcp://{address}")
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme not in ("tcp", "tls") or not parts.hostname or not port:
        raise ConfigError(f"{flag} ({address}) must look like tls://host:8786 or tcp://127.0.0.1:8786")
    return parts.scheme, parts.hostname, port


def check_scheduler_address(address: str, *, insecure: bool = False, flag: str = "--scheduler") -> str | None:
    """Refuse a plain ``tcp://`` scheduler on another host (:class:`ConfigError`, before
    anything connects): plain Dask runs whatever function any client that reaches it sends.
    Returns the warning to print when ``insecure`` lets one through, else None."""
    scheme, host, _ = split_address(address, flag)
    if scheme == "tls" or is_loopback(host):
        return None
    if not insecure:
        raise ConfigError(
            f"{flag} {address} is plain TCP to another host, which lets anyone who reaches it run code "
            f"in the cluster: make certificates with `digen certs` and use tls:// with --security, or pass "
            f"--insecure on a network you trust"
        )
    return (
        f"--insecure: {address} is plain TCP; anyone who reaches the scheduler or a worker can run code "
        f"in them (digen certs and tls:// close that)"
    )


def listen_host(scheduler: str) -> str:
    """The address a worker of ``scheduler`` listens on: the local address that routes to the
    scheduler (127.0.0.1 for a scheduler on loopback), found without sending anything."""
    from distributed.utils import get_ip

    _, host, port = split_address(scheduler)
    if is_loopback(host):
        return LOOPBACK
    try:
        return get_ip(host, port)
    except (OSError, ValueError):
        return LOOPBACK


def check_reachable(address: str, timeout_s: float = 10.0, security: SecurityConfig | None = None) -> None:
    """Open (and close) a connection to a Dask address (``tcp://`` or ``tls://``), or raise
    :class:`ConnectionFailure` within ``timeout_s`` naming the address. With ``tls://`` and
    this node's ``security`` files, the TLS handshake is made too: a scheduler whose
    certificate this node's CA did not sign fails here, in one line (and the scheduler logs
    no failed handshake, as it does for a bare TCP probe of its TLS port). A ``tcp://``
    address whose scheduler speaks TLS is a :class:`ConfigError` naming that
    (:func:`_speaks_tls`), where Dask would end in "Nanny failed to start"."""
    scheme, host, port = split_address(address)
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            if scheme == "tls" and security is not None and security.enabled:
                with _client_context(security).wrap_socket(sock):
                    pass
            elif scheme == "tcp" and _speaks_tls(sock, min(timeout_s, PLAIN_HELLO_S)):
                raise ConfigError(
                    f"the Dask scheduler at {address} speaks TLS, not plain TCP: use "
                    f"{address.replace('tcp://', 'tls://', 1) if '://' in address else 'tls://' + address} "
                    f"with --security FILE (this node's files from `digen certs`)"
                )
    except ssl.SSLError as exc:
        raise ConnectionFailure(
            f"TLS with the Dask scheduler at {address} failed ({exc.reason or exc}): its certificate and this "
            f"node's must come from the same `digen certs` CA"
        ) from None
    except OSError as exc:
        reason = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or type(exc).__name__)
        raise ConnectionFailure(
            f"cannot reach the Dask scheduler at {address} ({reason}); start it with `dask scheduler` "
            f"(or docker compose up scheduler) and check the address and port"
        ) from None


PLAIN_HELLO_S = 3.0
"""How long :func:`_speaks_tls` waits for a plain Dask scheduler's first bytes: it sends its
handshake as soon as it accepts a connection, where a TLS one waits for the client's."""


def _speaks_tls(sock: socket.socket, wait_s: float) -> bool:
    """Whether the listener ``sock`` is connected to answers as TLS does: it sends nothing
    within ``wait_s`` (a plain Dask server writes its handshake at once), and a TLS
    ClientHello gets a TLS answer (a handshake, or a TLS alert: no certificate was shown)."""
    sock.settimeout(wait_s)
    try:
        if sock.recv(1, socket.MSG_PEEK):
            return False  # a plain Dask handshake (or any server that speaks first)
    except TimeoutError:
        pass
    except OSError:
        return False
    probe = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    probe.check_hostname = False
    probe.verify_mode = ssl.CERT_NONE  # nothing is sent or trusted: only the answer's kind counts
    try:
        with probe.wrap_socket(sock, do_handshake_on_connect=False) as tls:
            tls.settimeout(wait_s)
            tls.do_handshake()
        return True
    except ssl.SSLError as exc:
        return "ALERT" in str(exc.reason or exc).upper()
    except OSError:
        return False


def _client_context(sec: SecurityConfig) -> ssl.SSLContext:
    """A TLS client context with this node's files: the CA's signature is checked, host names
    are not (as Dask does)."""
    ctx = ssl.create_default_context(cafile=sec.ca_file)
    ctx.check_hostname = False
    ctx.load_cert_chain(str(sec.cert_file), str(sec.key_file))
    return ctx


# ---------------------------------------------------------------------------------------------
# TLS


def load_security(path: Path) -> SecurityConfig:
    """The ``security:`` section of a YAML file (a job config works), paths made absolute
    relative to the file's folder; every file must exist."""
    path = Path(path)
    data = read_yaml(path, "--security file")
    section = data.get("security", data) if isinstance(data, dict) else None
    if not isinstance(section, dict):
        raise ConfigError(f"{path} must hold a security: section with ca_file, cert_file, key_file")
    try:
        sec = SecurityConfig.model_validate(section)
    except ValueError as exc:
        raise ConfigError(f"{path}: security section is invalid: {exc}") from None
    return absolute_security(sec, path.parent)


def absolute_security(sec: SecurityConfig, base: Path) -> SecurityConfig:
    """``sec`` with its file paths absolute (relative ones resolved against ``base``);
    a :class:`ConfigError` listing every missing or absent file."""
    if not sec.enabled:
        return sec
    update, problems = {}, []
    for name in ("ca_file", "cert_file", "key_file"):
        value = getattr(sec, name)
        if value is None:
            problems.append(f"security.{name} is missing: TLS needs ca_file, cert_file and key_file together")
            continue
        p = Path(value).expanduser()
        p = p if p.is_absolute() else (base / p)
        if not p.exists():
            problems.append(f"security.{name} ({value}) does not exist; docs/deploy.md shows how to make it")
        update[name] = str(p.resolve())
    if problems:
        raise ConfigError(problems)
    return sec.model_copy(update=update)


def dask_security(sec: SecurityConfig | None, side: Literal["client", "worker", "all"] = "all"):
    """A ``distributed.Security`` from a node's section, or None (no TLS): ``side``'s
    certificate is the node's (``all``: the client's, the worker's and the scheduler's, for a
    process that is all three, as the embedded cluster's is)."""
    if sec is None or not sec.enabled:
        return None
    from distributed import Security

    sides = ("client", "worker", "scheduler") if side == "all" else (side,)
    files = {}
    for s in sides:
        files[f"tls_{s}_cert"], files[f"tls_{s}_key"] = sec.cert_file, sec.key_file
    return Security(tls_ca_file=sec.ca_file, require_encryption=sec.require_encryption, **files)


def dask_tls_config(sec: SecurityConfig | None) -> dict[str, object]:
    """Dask config keys that make a ``Client`` created without ``security=`` use TLS."""
    if sec is None or not sec.enabled:
        return {}
    return {
        "distributed.comm.tls.ca-file": sec.ca_file,
        "distributed.comm.tls.client.cert": sec.cert_file,
        "distributed.comm.tls.client.key": sec.key_file,
        "distributed.comm.require-encryption": sec.require_encryption,
    }


# ---------------------------------------------------------------------------------------------
# the worker process


def check_sp_group(sp_group: str | None, role: str) -> None:
    """``ConfigError`` unless ``--sp-group`` is unset or a short name on a rollout worker."""
    if sp_group is None:
        return
    if not sp_group or not all(c.isalnum() or c in "-_." for c in sp_group):
        raise ConfigError(f"--sp-group ({sp_group!r}) must be a short name such as node3 or rack-a")
    if role != "rollout":
        raise ConfigError(f"--sp-group ({sp_group}) is for rollout workers; this one has --role {role}")


def run_worker(
    scheduler: str,
    role: str,
    gpu_type: str,
    *,
    name: str | None = None,
    device: str | None = None,
    nthreads: int = 1,
    host: str | None = None,
    security: SecurityConfig | None = None,
    on_ready: Callable[[str, str], None] | None = None,
    sp_group: str | None = None,
    insecure: bool = False,
) -> None:
    """Run a Dask worker for digen until it is stopped (SIGTERM, SIGINT, or the scheduler
    closing). ``on_ready(name, address)`` is called once it has joined the scheduler.
    ``sp_group``: the rollout workers of one named group form sequence-parallel replicas
    together (``rollout.sequence_parallel``; :func:`check_sp_group`). A plain ``tcp://``
    scheduler on another host needs ``insecure`` (:func:`check_scheduler_address`); with
    ``tls://``, ``security`` is this node's own files. The worker listens on ``host``
    (default :func:`listen_host`), over TLS with a ``tls://`` scheduler."""
    check_sp_group(sp_group, role)
    if role not in ROLES:
        raise ConfigError(f"--role ({role}) must be rollout, trainer or reward")
    check_gpu_type(gpu_type)
    if nthreads < 1:
        raise ConfigError(f"--nthreads ({nthreads}) must be at least 1")
    env = device_env(device)
    sec = _joinable(scheduler, security, insecure)
    import asyncio

    spec = (worker_resources(role, gpu_type, sp_group), name or worker_name(role, gpu_type), env)
    asyncio.run(_serve(scheduler, [spec], nthreads, host or listen_host(scheduler), sec, on_ready))


def _joinable(scheduler: str, security: SecurityConfig | None, insecure: bool):
    """Check, before anything joins, that ``scheduler`` may be joined from here (a plain
    ``tcp://`` on another host only with ``insecure``; ``tls://`` only with this node's
    ``security``) and answers; returns the worker's ``distributed.Security`` (or None)."""
    check_scheduler_address(scheduler, insecure=insecure)
    sec = dask_security(security, "worker")
    if scheduler.startswith("tls://") and sec is None:
        raise ConfigError(
            f"--scheduler {scheduler} uses TLS: pass --security FILE with this node's security: section "
            f"(digen certs makes one per node)"
        )
    check_reachable(scheduler, security=security)
    return sec


def node_placement(role: str, gpus: str, gpu_type: str | None = None) -> Placement:
    """One worker per GPU of ``gpus`` (``auto``: every visible one; ``0,1,2``: those ids),
    roles from ``role`` (:func:`~digen.cluster.placement.parse_roles`), named
    ``<role>-<type>-<host>-<id>-gNN`` (NN: the GPU id). ``gpu_type`` overrides the types read
    from the GPUs' names."""
    found = discover()
    ids = parse_gpu_ids(gpus)
    if ids is not None:
        have = {g.index: g for g in found}
        missing = [i for i in ids if i not in have]
        if missing:
            raise ConfigError(
                f"--gpus ({gpus}): no GPU {', '.join(map(str, missing))} here "
                f"(visible: {', '.join(str(i) for i in sorted(have)) or 'none'})"
            )
        found = [have[i] for i in dict.fromkeys(ids)]
    if not found:
        raise ConfigError(f"--gpus {gpus}: no GPU visible here (nvidia-smi lists none); use --device cpu")
    if gpu_type is not None:
        check_gpu_type(gpu_type)
    roles = parse_roles(role, len(found))
    planned = place([(f"{r}-{i:02d}", r) for i, r in enumerate(roles)], found, what="--gpus")
    host = socket.gethostname().split(".")[0] or "host"
    tag = uuid.uuid4().hex[:6]
    slots = []
    for s in planned.slots:
        kind = gpu_type or s.gpu_type
        name = f"{s.role}-{kind}-{host}-{tag}-g{s.gpus[0]:02d}"
        slots.append(type(s)(name, s.role, s.gpus, kind, s.cuda_ids))
    return Placement(sorted(slots, key=lambda s: s.gpus), planned.idle)


def check_gpu_type(gpu_type: str) -> None:
    if not gpu_type or not all(c.isalnum() or c in "-_." for c in gpu_type):
        raise ConfigError(f"--gpu-type ({gpu_type!r}) must be a short name such as h100, a10g or cpu")


def run_node_workers(
    scheduler: str,
    placement: Placement,
    *,
    nthreads: int = 1,
    host: str | None = None,
    security: SecurityConfig | None = None,
    on_ready: Callable[[str, str], None] | None = None,
    sp_group: str | None = None,
    insecure: bool = False,
) -> None:
    """Run one Dask worker (under its Nanny) per slot of ``placement`` (:func:`node_placement`)
    in this process until stopped; each worker process sees only its slot's GPU. Listens and
    checks the scheduler's address as :func:`run_worker` does."""
    if nthreads < 1:
        raise ConfigError(f"--nthreads ({nthreads}) must be at least 1")
    for s in placement.slots:
        check_sp_group(sp_group if s.role == "rollout" else None, s.role)
    sec = _joinable(scheduler, security, insecure)
    import asyncio

    specs = [
        (worker_resources(s.role, s.gpu_type, sp_group if s.role == "rollout" else None), s.worker, s.env())
        for s in placement.slots
    ]
    asyncio.run(_serve(scheduler, specs, nthreads, host or listen_host(scheduler), sec, on_ready))


async def _serve(scheduler, specs, nthreads, host, security, on_ready) -> None:
    """Serve one Nanny per ``(resources, name, env)`` of ``specs`` until all have finished or
    SIGTERM/SIGINT closes them."""
    import asyncio
    import signal

    from distributed import Nanny

    nannies = [
        Nanny(
            scheduler,
            protocol=split_address(scheduler)[0],
            nthreads=nthreads,
            resources=resources,
            name=name,
            env=env,
            host=host,
            security=security,
            memory_limit=0,
            death_timeout=60,
            silence_logs=logging.WARNING,
        )
        for resources, name, env in specs
    ]
    await asyncio.gather(*nannies)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: [asyncio.ensure_future(n.close()) for n in nannies])
    try:
        if on_ready is not None:
            for nanny, (_, name, _) in zip(nannies, specs, strict=True):
                on_ready(name, nanny.worker_address or nanny.address)
        await asyncio.gather(*(n.finished() for n in nannies))
    finally:
        for nanny in nannies:
            if nanny.status.name not in ("closed", "closing", "failed"):
                await nanny.close()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


__all__ = [
    "LOOPBACK",
    "absolute_security",
    "check_reachable",
    "check_scheduler_address",
    "dask_security",
    "dask_tls_config",
    "device_env",
    "is_loopback",
    "listen_host",
    "load_security",
    "node_placement",
    "run_node_workers",
    "run_worker",
    "worker_name",
]
