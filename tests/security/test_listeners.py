"""Nobody outside the job gets in: a running embedded job listens on loopback only, and from a
second host (a network namespace) its scheduler, workers, blob servers and gloo pairs are
all out of reach; the rendezvous opens no port at all (a store in the job's Redis). Another
user of this machine reaches every port on loopback, but the cluster is mutual TLS with the
job's own certificates: it runs no code in the job and fetches no blob, even with the job's
blob key, where the same probe with the job's files does both.

One job runs for the module: disaggregated, one rollout worker and two trainers that sum
their gradients with an all-reduce (so the trainer group's rendezvous and gloo pairs exist),
the Dask dashboard on. Both trainers are held inside the step's process group (the fault
point ``reduce``) while the tests look at the job's processes and probe them; then it
finishes.
"""

from __future__ import annotations

import ipaddress
import json
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from tests.conftest import faults_on
from tests.reliability.conftest import fault_config

from .conftest import Namespace, OtherUser

pytestmark = pytest.mark.slow  # one job of 1 iteration on 3 worker processes (~40 s on 2 cores)

HOLD_FLAG = "probed"


@dataclass
class HeldJob:
    job_id: str
    listeners: list[tuple[int, str, str, int]]
    """(pid, process name, address, port) of every TCP listener of this process and its descendants."""
    scheduler: str
    workers: dict[str, str]
    """worker name -> Dask address"""
    rendezvous: list[dict]
    """the trainer group's published formations"""
    store_keys: int
    """keys the formations' stores hold in the job's Redis (gloo's rank addresses among them)"""
    tls: tuple[str, str, str]
    """the job's own TLS files (CA, certificate, key) the cluster was started with"""
    blob_key: str
    """the job's blob key (hex)"""
    weights: list[str]
    """blob servers that serve weights version 0"""
    nannies: list[str]
    """the workers' nannies' Dask addresses"""


def tree_listeners() -> list[tuple[int, str, str, int]]:
    """Every listening TCP socket of this process and all its descendants."""
    me = psutil.Process()
    found = []
    for p in [me, *me.children(recursive=True)]:
        try:
            conns = p.net_connections(kind="inet")
            name = " ".join(p.cmdline()[:3])[-60:]
        except psutil.Error:  # a process that just exited
            continue
        for c in conns:
            if c.status == psutil.CONN_LISTEN:
                found.append((p.pid, name, c.laddr.ip, c.laddr.port))
    return found


def is_loopback(ip: str) -> bool:
    return ipaddress.ip_address(ip.split("%")[0]).is_loopback


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def _wait(cond, timeout: float, what: str, job: threading.Thread) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if not job.is_alive():
            raise AssertionError(f"the job ended before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def held_job(tiny_sd3: Path, tmp_path_factory) -> Iterator[HeldJob]:
    from digen.cluster.cluster import scheduler_identity
    from digen.controlplane.jobstate import JobState
    from digen.controlplane.redis_conn import connect
    from digen.controlplane.trainer_group import TrainerGroup
    from digen.runtime.controller import run_distributed
    from digen.testing.faults import Fault, arm, clear, fired

    cfg = fault_config(
        tiny_sd3,
        iterations=1,
        schedule={"mode": "disaggregated", "gap": True, "max_staleness": 0},
        cluster__local={"rollout_workers": 1, "trainer_workers": 2, "dashboard": True},
        train__reduce="allreduce",
    )
    job_id = f"sec-{uuid.uuid4().hex[:8]}"
    out = tmp_path_factory.mktemp("held") / "run"
    started: dict = {}
    errors: list[BaseException] = []
    with faults_on():
        r = connect(None)
        clear(r, job_id)
        holds = [
            Fault("reduce", "hold", worker=w, iteration=0, flag=HOLD_FLAG, seconds=240)
            for w in ("trainer-0", "trainer-1")
        ]
        arm(r, job_id, *holds)

        def on_start(ctl) -> None:
            started["scheduler"] = ctl.cluster.scheduler_address
            sec = ctl.cluster.security
            started["tls"] = (sec.tls_ca_file, sec.tls_client_cert, sec.tls_client_key)
            info = scheduler_identity(ctl.client)["workers"].values()
            started["nannies"] = sorted(w["nanny"] for w in info if w.get("nanny"))
            started["workers"] = {n: w.address for n, w in ctl.members.workers.items()}

        def run() -> None:
            try:
                run_distributed(cfg, out, job_id=job_id, on_start=on_start)
            except BaseException as exc:  # noqa: BLE001 - reported by the fixture
                errors.append(exc)

        job = threading.Thread(target=run, name="held-job", daemon=True)
        job.start()
        try:
            held = lambda: sum(f["point"] == "reduce" for f in fired(r, job_id)) == 2  # noqa: E731
            _wait(held, 240, "both trainers to be in the step's process group", job)
            addr_keys = [k for k in r.scan_iter(f"digen:{job_id}:tg:addr:*") if b":store:" not in k]
            rendezvous = [json.loads(r.get(k)) for k in addr_keys if r.get(k)]
            store_keys = sum(1 for _ in r.scan_iter(f"digen:{job_id}:tg:addr:*:store:*"))
            yield HeldJob(
                job_id,
                tree_listeners(),
                started["scheduler"],
                started["workers"],
                rendezvous,
                store_keys,
                started["tls"],
                JobState(r, job_id).blob_key().hex(),
                TrainerGroup(r, job_id).holders_of(0),
                started["nannies"],
            )
        finally:
            r.sadd(f"digen:faults:{job_id}:flags", HOLD_FLAG)  # digen.testing.faults' flag set
            job.join(timeout=300)
            clear(r, job_id)
            r.close()
    assert not errors, errors
    assert not job.is_alive(), "the job did not finish after the probes"


def test_a_running_embedded_job_listens_on_loopback_only(held_job: HeldJob):
    open_ports = {port for *_, port in held_job.listeners}
    # the listeners this test must see (or it proves nothing): the scheduler, the dashboard's
    # host process, every worker; the trainer group's rendezvous is a store in Redis, no port
    assert _port(held_job.scheduler) in open_ports
    for name, address in held_job.workers.items():
        assert _port(address) in open_ports, name
    assert held_job.rendezvous, "the trainers published no rendezvous"
    for addr in held_job.rendezvous:
        assert is_loopback(addr["host"]) and "port" not in addr and addr["store"], addr
    assert held_job.store_keys >= 2, "the two trainers met in no store in Redis"
    for name, address in held_job.workers.items():  # its Dask port, HTTP server and blob server
        pid = next(pid for pid, _, _, port in held_job.listeners if port == _port(address))
        assert sum(p == pid for p, *_ in held_job.listeners) >= 3, (name, held_job.listeners)
    assert held_job.scheduler.startswith("tls://127.0.0.1:")
    assert all(a.startswith("tls://127.0.0.1:") for a in held_job.workers.values())
    exposed = [entry for entry in held_job.listeners if not is_loopback(entry[2])]
    assert exposed == [], f"listeners on a non-loopback address: {exposed}"


PROBE = r"""
import asyncio, json, socket, sys

target = json.loads(sys.argv[1])
host, out = target["host"], {}

def refused(port):
    try:
        with socket.create_connection((host, port), timeout=3):
            return False
    except OSError as exc:
        return type(exc).__name__

out["connect"] = {str(p): refused(p) for p in target["ports"]}
out["control"] = refused(target["control"])  # a listener bound to this address: reachable

async def dask_run(port):
    from distributed.core import rpc
    from distributed.protocol.pickle import dumps
    import os
    try:
        async with rpc(f"tcp://{host}:{port}", timeout=3) as w:
            res = await asyncio.wait_for(w.run(function=dumps(os.getpid), args=dumps(()), kwargs=dumps({})), 5)
            return f"ran: {res}"
    except Exception as exc:
        return type(exc).__name__

out["dask_run"] = {str(p): asyncio.run(dask_run(p)) for p in target["workers"]}

async def join():
    from distributed import Worker
    try:
        w = await asyncio.wait_for(Worker(f"tcp://{host}:{target['scheduler']}", nthreads=1, death_timeout=3), 8)
        await w.close()
        return "joined"
    except Exception as exc:
        return type(exc).__name__

out["join"] = asyncio.run(join())
print(json.dumps(out))
"""


def test_a_second_host_reaches_nothing_of_the_job(held_job: HeldJob, netns: Namespace):
    """From the namespace, this machine is ``netns.host``: every port of the job is refused
    there, while a listener bound to that address answers (the probe would see an open one)."""
    import socket

    control = socket.create_server((netns.host, 0))
    try:
        target = {
            "host": netns.host,
            "ports": sorted({port for *_, port in held_job.listeners}),
            "control": control.getsockname()[1],
            "workers": [_port(a) for a in held_job.workers.values()],
            "scheduler": _port(held_job.scheduler),
        }
        res = netns.python(PROBE, json.dumps(target), timeout=180)
    finally:
        control.close()
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["control"] is False, "the namespace cannot reach this machine at all: the probe proves nothing"
    assert all(got["connect"].values()), got["connect"]  # every port: an error, none connected
    assert got["dask_run"] and not any(v.startswith("ran") for v in got["dask_run"].values()), got
    assert got["join"] != "joined", got


LOCAL_PROBE = r"""
import asyncio, json, os, socket, ssl, sys

t = json.loads(sys.argv[1])
files, out = t["tls"], {}

def client_ctx():
    if files:  # the job's own files: what the job's processes show
        from digen.dataplane.blobs import tls_contexts
        return tls_contexts(*files)[1]
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # TLS without a certificate, trusting anything
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    return ctx

def port(a):
    return int(a.rsplit(":", 1)[1])

def reaches(p):
    try:
        with socket.create_connection(("127.0.0.1", p), timeout=3):
            return True
    except OSError as exc:
        return type(exc).__name__

out["connect"] = [reaches(port(a)) for a in [t["scheduler"], *t["workers"], *t["nannies"]]]
try:
    open(files[2] if files else t["key_file"], "rb").close()
    out["read_key"] = True
except OSError as exc:
    out["read_key"] = type(exc).__name__

async def run(address, op):
    from distributed.core import rpc
    from distributed.protocol.pickle import dumps
    extra = {"connection_args": {"ssl_context": client_ctx()}} if address.startswith("tls") else {}
    try:
        async with rpc(address, timeout=5, **extra) as r:
            call = getattr(r, op)(function=dumps(os.getuid), args=dumps(()), kwargs=dumps({}))
            return f"ran: {await asyncio.wait_for(call, 10)}"
    except Exception as exc:
        return type(exc).__name__

runs = {}
for address, op in [(t["scheduler"], "run_function")] + [(w, "run") for w in t["workers"] + t["nannies"]]:
    for scheme in ("tls", "tcp"):
        runs[f"{scheme}:{port(address)}"] = asyncio.run(run(f"{scheme}://127.0.0.1:{port(address)}", op))
out["dask_run"] = runs

from digen.dataplane.auth import Keyring
from digen.dataplane.blobs import BlobLost, connection, fetch
keys = Keyring()
keys.add(t["job"], bytes.fromhex(t["blob_key"]))  # the job's key, as if it had leaked
fetched = {}
for address in t["weights"]:
    for how in ("tls", "plain"):
        try:
            with connection(address, client_ctx() if how == "tls" else None) as ch:
                got, _ = fetch(address, f"{t['job']}:weights:0", keys=keys, sock=ch)
                fetched[f"{how}:{address}"] = f"fetched {len(got)} tensors"
        except BlobLost as exc:
            fetched[f"{how}:{address}"] = "BlobLost"
out["blob"] = fetched
print(json.dumps(out))
"""


def test_another_local_user_runs_no_code_in_the_job_and_fetches_no_blob(
    held_job: HeldJob, other_user: OtherUser
):
    """As ``nobody``: every port of the job is reachable on loopback, yet Dask ``run`` on the
    scheduler, each worker and each nanny (tls:// without the job's certificate, and tcp://) and a fetch
    of the weights, signed with the job's blob key, are all refused; the job's TLS key cannot
    be read. The same probe run by the job's user with the job's files runs code in every one
    of them and fetches the weights: what refuses the other user is the credentials alone."""
    assert held_job.weights, "no worker serves weights version 0: the fetch would prove nothing"
    target = {
        "scheduler": held_job.scheduler,
        "workers": sorted(held_job.workers.values()),
        "nannies": held_job.nannies,
        "job": held_job.job_id,
        "blob_key": held_job.blob_key,
        "weights": held_job.weights,
    }
    theirs = other_user.python(LOCAL_PROBE, json.dumps({**target, "tls": None, "key_file": held_job.tls[2]}))
    assert theirs.returncode == 0, theirs.stderr[-2000:]
    got = json.loads(theirs.stdout.strip().splitlines()[-1])
    assert len(held_job.nannies) == len(held_job.workers)
    assert got["connect"] == [True] * (1 + 2 * len(held_job.workers)), got  # loopback reaches it all
    assert got["read_key"] == "PermissionError", got
    assert got["dask_run"] and not any(v.startswith("ran") for v in got["dask_run"].values()), got
    assert got["blob"] and set(got["blob"].values()) == {"BlobLost"}, got
    ours = subprocess.run(
        [sys.executable, "-c", LOCAL_PROBE, json.dumps({**target, "tls": list(held_job.tls)})],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert ours.returncode == 0, ours.stderr[-2000:]
    mine = json.loads(ours.stdout.strip().splitlines()[-1])
    tls_runs = {k: v for k, v in mine["dask_run"].items() if k.startswith("tls")}
    assert len(tls_runs) == 1 + 2 * len(held_job.workers) and all(
        v.startswith("ran") for v in tls_runs.values()
    ), mine
    assert mine["read_key"] is True
    assert all(v.startswith("fetched") for k, v in mine["blob"].items() if k.startswith("tls")), mine
