"""The Dask side: start or join a cluster, find workers by role and GPU type, place loops.

Workers carry Dask *resources*: ``{"rollout": 1}`` or ``{"trainer": 1}``, plus
``{"gpu-<TYPE>": 1}``. The embedded default is a local cluster whose workers are described by
the config's ``cluster.local`` section; ``--scheduler ADDR`` joins an existing cluster whose
workers were started with ``digen worker``.

Every listener of the local cluster binds loopback (:data:`LOOPBACK`): the scheduler, its
dashboard, the nannies and the workers (whose blob servers and process-group rendezvous bind
their worker's host, :mod:`digen.workers.context`). Plain Dask runs any function a client that
reaches it sends, so nothing of an embedded job may be reachable from another host, nor from
another user of this one: the job's local cluster speaks ``tls://``, every process showing
the node's certificate (the config's ``security:`` section) or, without one, the job's own
(:class:`digen.cluster.certs.JobCerts`, made when the job starts).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

from digen.controlplane.resources import gpu_type_of, sp_group_of, worker_resources
from digen.core.events import Role
from digen.errors import ConnectionFailure
from digen.startup import phase

log = logging.getLogger(__name__)

worker_console_level: int = logging.WARNING
"""Level at which a local worker process prints Dask's log to its stderr (the console); the
CLI sets ERROR (INFO with --verbose) once it routes the log to the run's file."""


@dataclass(frozen=True)
class WorkerInfo:
    address: str
    name: str
    role: Role
    gpu_type: str
    sp_group: str | None = None
    """``digen worker --sp-group NAME`` (Dask resource ``sp-NAME``): the workers of one named
    group form sequence-parallel replicas together (:mod:`digen.runtime.sp_group`)."""


FORKSERVER_PRELOAD = (
    "distributed",
    "digen.workers.loop",
    "digen.workers.preload",
    "diffusers.models.modeling_utils",
    "transformers.modeling_utils",
    "peft",
    "digen.workers.forkserver",
)
"""Modules the fork server imports once for every worker it forks: what a worker loop and a
policy load need (a missing one is skipped). The last, :mod:`digen.workers.forkserver`, imports the
families' pipeline code and freezes the server's objects, so its forked workers share them."""

FORKSERVER_SHARED = ("distributed",)
"""What the controller imports before it forks the fork server (:func:`prefork_server`), so
the two share it: Dask. The rest of :data:`FORKSERVER_PRELOAD` (torch with the workers'
code) the server imports after the fork: the controller holds no tensor and imports no torch."""


def use_start_method(method: str) -> None:
    """Make this process's Dask nannies start worker processes with ``method``
    (``forkserver``: from a server that imported :data:`FORKSERVER_PRELOAD`; ``spawn``)."""
    import dask
    from distributed.utils import get_mp_context

    dask.config.set({"distributed.worker.multiprocessing-method": method})
    ctx = get_mp_context()  # Dask sets its own preload list on the first call; ours replaces it
    if method == "forkserver":
        ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))


def prefork_server() -> int | None:
    """Start the fork server now as a fork of this process (:func:`digen.workers.forkserver.start_forked_server`),
    before this process computes anything or starts a thread: the server shares this process's
    Dask (:data:`FORKSERVER_SHARED`), imports the workers' code and torch once, and the workers
    it forks share them. Its pid, or ``None`` where forking is not safe (the spawned server is
    used)."""
    from digen.workers.forkserver import start_forked_server

    return start_forked_server(FORKSERVER_PRELOAD, FORKSERVER_SHARED)


SIGINT_PRELOAD = "digen.workers.interrupt"
"""The local workers' Dask preload: they ignore a Ctrl-C, which the controller handles."""

LOOPBACK = "127.0.0.1"
"""Where every listener of the embedded cluster binds."""


def nanny_options(
    name: str,
    role: str,
    gpu_type: str,
    threads: int,
    extra_env: dict[str, str] | None = None,
    security=None,
) -> dict:
    """A local worker's Nanny options. ``host``: the nanny *and* its worker listen on loopback
    (a Nanny given no host binds itself near the scheduler but leaves its worker on every
    interface). ``env`` hands the worker this process's environment as it is now: a worker
    forked from the fork server would otherwise see the environment the server started with,
    not variables set since (``DIGEN_HOME``, ``DIGEN_FAULTS``, ...), which a spawned worker
    inherits. ``extra_env`` goes on top: a placed worker's GPU
    (:meth:`digen.cluster.placement.Slot.env`). ``security``: a ``distributed.Security`` (TLS)
    or None. The worker process ignores SIGINT (:data:`SIGINT_PRELOAD`)."""
    options = {
        "nthreads": threads,
        "resources": worker_resources(role, gpu_type),
        "name": name,
        "memory_limit": 0,
        "silence_logs": worker_console_level,
        "env": {**os.environ, **(extra_env or {})},
        "host": LOOPBACK,
        "preload": [SIGINT_PRELOAD],
    }
    if security is not None:
        options.update(security=security, protocol="tls")
    return options


def start_local_cluster(
    rollout: int,
    trainer: int,
    gpu_type: str,
    threads: int,
    dashboard: bool = False,
    start_method: str = "forkserver",
    reward: int = 0,
    placement=None,
    security=None,
):
    """A local Dask cluster of ``rollout`` + ``trainer`` (+ ``reward``) worker processes with
    role resources, every listener on loopback. ``placement``
    (:class:`~digen.cluster.placement.Placement`): each worker's GPU, its environment and its
    ``gpu-<type>`` tag; None: every worker tagged ``gpu_type``.

    Returns ``(cluster, client)``. Each worker is a separate process (a Nanny restarts it if
    it dies), named ``rollout-0``, ``trainer-0``, ..., started by ``start_method``
    (:func:`use_start_method`); the nannies start them all at once. ``dashboard`` serves
    Dask's dashboard (bokeh, about 50 MiB in the scheduler's process) on a free local port.
    ``security`` (a ``distributed.Security``): every connection is ``tls://`` with it.
    """
    from distributed import Client, Nanny, Scheduler, SpecCluster

    use_start_method(start_method)

    workers = {}
    for role, n in (("rollout", rollout), ("trainer", trainer), ("reward", reward)):
        for i in range(n):
            name = f"{role}-{i}"
            slot = placement.slot(name) if placement is not None else None
            workers[name] = {
                "cls": Nanny,
                "options": nanny_options(
                    name,
                    role,
                    slot.gpu_type if slot else gpu_type,
                    threads,
                    slot.env() if slot else None,
                    security,
                ),
            }
    options = {"dashboard": dashboard, "dashboard_address": f"{LOOPBACK}:0", "host": LOOPBACK}
    if security is not None:
        options.update(security=security, protocol="tls")
    scheduler = {"cls": Scheduler, "options": options}
    cluster = SpecCluster(
        workers=workers, scheduler=scheduler, silence_logs=worker_console_level, security=security
    )
    client = Client(cluster, security=security)
    client.wait_for_workers(rollout + trainer + reward, timeout=120)
    return cluster, client


class LocalClusterStart:
    """:func:`start_local_cluster` in a thread, so the caller loads its own copy of the model
    meanwhile; once the workers are up, each gets :func:`digen.workers.preload.preload_policy` of
    ``cfg_json`` (its job loop then finds the model loaded). :meth:`result` waits for the
    cluster; :meth:`close` closes it (workers first) and removes ``certs``, the job's own TLS
    files (:class:`digen.cluster.certs.JobCerts`) when it was started with them; :meth:`discard`
    closes the client too, when the caller fails before taking it."""

    def __init__(
        self,
        rollout: int,
        trainer: int,
        gpu_type: str,
        threads: int,
        start_method: str = "forkserver",
        cfg_json: dict | None = None,
        reward: int = 0,
        dashboard: bool = False,
        placement=None,
        security=None,
        certs=None,
    ):
        self._args = (rollout, trainer, gpu_type, threads)
        self._certs = certs
        self._start_method, self._reward, self._dashboard = start_method, reward, dashboard
        self._placement, self._security = placement, security
        self._cfg_json = cfg_json
        self._made: tuple | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="digen-cluster-start")
        self._thread.start()

    def _run(self) -> None:
        try:
            with phase("cluster start"):
                self._made = start_local_cluster(
                    *self._args,
                    dashboard=self._dashboard,
                    start_method=self._start_method,
                    reward=self._reward,
                    placement=self._placement,
                    security=self._security,
                )
            if self._cfg_json is not None:
                self._preload(self._made[1])
        except BaseException as exc:  # noqa: BLE001 - handed to the caller by result()
            self._error = exc

    def _preload(self, client) -> None:
        from distributed import fire_and_forget

        from digen.workers.preload import preload_policy

        for w in list_workers(client):
            if w.role == Role.REWARD:  # a reward worker loads no policy
                continue
            fire_and_forget(
                client.submit(preload_policy, self._cfg_json, self._args[3], workers=[w.address], pure=False)
            )

    def result(self):
        """``(cluster, client)`` once started; raises what the start raised."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._made is not None
        return self._made

    def discard(self) -> None:
        """Close the client and the cluster (when started) without using them."""
        self._thread.join()
        if self._made is not None:
            self._made[1].close()
        self.close()

    def close(self) -> None:
        """Close the cluster (when started), then remove the job's TLS files (when made)."""
        self._thread.join()
        try:
            if self._made is not None:
                close_local_cluster(self._made[0])
        finally:
            if self._certs is not None:
                self._certs.remove()


def close_local_cluster(cluster) -> None:
    """Close a local cluster workers first, then its scheduler.

    ``SpecCluster.close`` stops the scheduler while its workers still run, so a worker's next
    heartbeat meets a closed stream and Dask logs an ERROR traceback to the console (seen on a
    loaded machine, where the workers' shutdown lags). Retiring the workers while the scheduler
    still answers (the same ``_correct_state`` path :func:`add_local_worker` scales up with)
    leaves none to heartbeat when the scheduler goes."""
    try:
        cluster.worker_spec.clear()
        cluster.sync(cluster._correct_state)
    finally:
        cluster.close()


def add_local_worker(cluster, role: str, gpu_type: str, threads: int = 1) -> str:
    """Scale a local cluster up by one worker of ``role`` (a worker joining mid-job)."""
    from distributed import Nanny

    n = sum(1 for k in cluster.worker_spec if k.startswith(role))
    name = f"{role}-{n}"
    tls = cluster.security if cluster.scheduler_address.startswith("tls://") else None  # as its others
    options = nanny_options(name, role, gpu_type, threads, security=tls)
    cluster.worker_spec[name] = {"cls": Nanny, "options": options}
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


def run_worker_loop(*args, **kwargs) -> dict:
    """:func:`digen.workers.loop.worker_loop`, imported where it runs: the controller places this on
    each worker (Dask pickles a function by its module and name), so the controller's process
    never imports the workers' code, nor torch with it."""
    from digen.workers.loop import worker_loop

    return worker_loop(*args, **kwargs)


def exit_process() -> None:
    """Run on a worker by the controller (``client.run``) after its loop failed: the process
    exits (just after answering) and its Nanny starts a fresh one: clean imports, a clean device."""
    threading.Timer(0.2, os._exit, args=(1,)).start()


def list_workers(client) -> list[WorkerInfo]:
    """Workers with a role resource, sorted by name. Untagged workers are ignored."""
    info = scheduler_identity(client)["workers"]
    out = []
    for addr, w in info.items():
        res = w.get("resources", {}) or {}
        role = next((r for r in (Role.ROLLOUT, Role.TRAINER, Role.REWARD) if r.value in res), None)
        if role is None:
            continue
        out.append(WorkerInfo(addr, str(w.get("name", addr)), role, gpu_type_of(res), sp_group_of(res)))
    return sorted(out, key=lambda w: w.name)


def scheduler_identity(client) -> dict:
    """The scheduler's identity with every worker, asked of the scheduler itself.

    Not ``client.scheduler_info(n_workers=-1)``: that refreshes the client's cached identity
    and then returns the cache, which the client's own periodic refresh overwrites with
    ``n_workers=0`` (no workers listed; distributed ``Client._update_scheduler_info``). Read
    between the two, every worker seems to have left at once: on a loaded machine the
    controller then re-queued the leased tasks of workers that were alive."""
    if _takes_n_workers(client):
        return client.sync(client.scheduler.identity, n_workers=-1)
    return client.scheduler_info()


def _takes_n_workers(client) -> bool:
    import inspect

    return "n_workers" in inspect.signature(client.scheduler_info).parameters
