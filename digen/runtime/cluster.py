"""The Dask side: start or join a cluster, find workers by role and GPU type, place loops.

Workers carry Dask *resources*: ``{"rollout": 1}`` or ``{"trainer": 1}``, plus
``{"gpu-<TYPE>": 1}``. The embedded default is a local cluster whose workers are described by
the config's ``cluster.local`` section; ``--scheduler ADDR`` joins an existing cluster whose
workers were started with ``digen worker``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from digen.core.events import Role
from digen.errors import ConnectionFailure

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerInfo:
    address: str
    name: str
    role: Role
    gpu_type: str


def worker_resources(role: str, gpu_type: str) -> dict[str, float]:
    return {role: 1, f"gpu-{gpu_type}": 1}


def start_local_cluster(
    rollout: int, trainer: int, gpu_type: str, threads: int, dashboard: bool = True, reward: int = 0
):
    """A local Dask cluster of ``rollout`` + ``trainer`` (+ ``reward``) worker processes with
    role resources.

    Returns ``(cluster, client)``. Each worker is a separate process (a Nanny restarts it if
    it dies), named ``rollout-0``, ``trainer-0``, ...
    """
    from distributed import Client, Nanny, Scheduler, SpecCluster

    workers = {}
    for role, n in (("rollout", rollout), ("trainer", trainer), ("reward", reward)):
        for i in range(n):
            workers[f"{role}-{i}"] = {
                "cls": Nanny,
                "options": {
                    "nthreads": threads,
                    "resources": worker_resources(role, gpu_type),
                    "name": f"{role}-{i}",
                    "memory_limit": 0,
                    "silence_logs": logging.WARNING,
                },
            }
    scheduler = {
        "cls": Scheduler,
        "options": {"dashboard": dashboard, "dashboard_address": "127.0.0.1:0", "host": "127.0.0.1"},
    }
    cluster = SpecCluster(workers=workers, scheduler=scheduler, silence_logs=logging.WARNING)
    client = Client(cluster)
    client.wait_for_workers(rollout + trainer + reward, timeout=120)
    return cluster, client


def add_local_worker(cluster, role: str, gpu_type: str, threads: int = 1) -> str:
    """Scale a local cluster up by one worker of ``role`` (a worker joining mid-job)."""
    from distributed import Nanny

    n = sum(1 for k in cluster.worker_spec if k.startswith(role))
    name = f"{role}-{n}"
    cluster.worker_spec[name] = {
        "cls": Nanny,
        "options": {
            "nthreads": threads,
            "resources": worker_resources(role, gpu_type),
            "name": name,
            "memory_limit": 0,
            "silence_logs": logging.WARNING,
        },
    }
    cluster.sync(cluster._correct_state)
    return name


def connect_scheduler(address: str, timeout_s: float = 10.0, security=None):
    """A client of the Dask scheduler at ``address``; a clear error when unreachable."""
    from distributed import Client

    try:
        return Client(address, timeout=timeout_s, security=security)
    except (OSError, TimeoutError) as exc:
        raise ConnectionFailure(
            f"cannot reach the Dask scheduler at {address} ({type(exc).__name__}: {exc}); start it with "
            f"`dask scheduler` (or docker compose up scheduler), or drop --scheduler to use a local cluster"
        ) from None


def list_workers(client) -> list[WorkerInfo]:
    """Workers with a role resource, sorted by name. Untagged workers are ignored."""
    info = (
        client.scheduler_info(n_workers=-1)["workers"]
        if _takes_n_workers(client)
        else client.scheduler_info()["workers"]
    )
    out = []
    for addr, w in info.items():
        res = w.get("resources", {}) or {}
        role = next((r for r in (Role.ROLLOUT, Role.TRAINER, Role.REWARD) if r.value in res), None)
        if role is None:
            continue
        gpu = next((k[4:] for k in res if k.startswith("gpu-")), "unknown")
        out.append(WorkerInfo(addr, str(w.get("name", addr)), role, gpu))
    return sorted(out, key=lambda w: w.name)


def _takes_n_workers(client) -> bool:
    import inspect

    return "n_workers" in inspect.signature(client.scheduler_info).parameters
