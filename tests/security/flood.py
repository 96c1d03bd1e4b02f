"""What the job-level flood tests share: the attacker (a script with no credentials that holds
connections to blob servers, idle or trickling bytes, and opens a new one for each the server
drops) and the choreography that puts it in place while a job is held, lets the job go on,
and tells from the order of events whether the job finished while the flood held.

The job: disaggregated, ``max_staleness`` 0 (every iteration's generation fetches the version
the step before made, and every train task fetches its group's trajectories), its rollout
worker held once it has fetched weights version 1 (the fault point ``sync``) until the flood
is in place. The attacker opens all its connections, says ``ready``, then holds them until
the test closes its stdin (it was told: the job had ended) or ``give_up_s`` passes (a hang
guard: against a server the flood starves, the job ends only after that).
"""

from __future__ import annotations

import json
import subprocess
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from digen.config import Config
from digen.testing.faults import Fault
from tests.conftest import faults_on

FLAG = "flooded"
GIVE_UP_S = 240
"""How long the attacker holds at most: past it the job would have stalled (a hang guard)."""

FLOOD = r"""
import json, select, socket, ssl, sys, time
t = json.loads(sys.argv[1])

def split(a):
    host, port = a.split("://")[-1].rsplit(":", 1)
    return host, int(port)

def client_hello():
    # the first bytes a TLS client sends: what a slowloris trickles into the server's handshake
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    out = ssl.MemoryBIO()
    obj = ctx.wrap_bio(ssl.MemoryBIO(), out)
    try:
        obj.do_handshake()
    except ssl.SSLWantReadError:
        pass
    return out.read()

# else a blob frame whose header never ends
TRICKLE = client_hello() if t["tls"] else bytes.fromhex(t["magic"]) + (999).to_bytes(8, "little") + b" " * 999
opened = {a: 0 for a in t["servers"]}
dropped = trickled = 0

def one(a, mode):
    try:
        s = socket.create_connection(split(a), timeout=5)
    except OSError:  # the server is gone (the job ended): nothing left to hold
        return None
    s.setblocking(False)
    opened[a] += 1
    return {"sock": s, "mode": mode, "sent": 0, "next": time.monotonic()}

modes = ["idle"] * t["idle"] + ["trickle"] * t["trickle"]
held = [[a, one(a, mode)] for a in t["servers"] for mode in modes]
print("ready", flush=True)
start, told = time.monotonic(), False
while time.monotonic() - start < t["give_up_s"]:
    if select.select([sys.stdin], [], [], 0.05)[0]:  # the test closed our stdin: stop
        told = True
        break
    now = time.monotonic()
    for entry in held:
        addr, c = entry
        if c is None:
            continue
        s, gone = c["sock"], False
        try:
            if s.recv(4096) == b"":
                gone = True  # whatever else the server says, we never answer
        except BlockingIOError:
            pass
        except OSError:
            gone = True
        if not gone and c["mode"] == "trickle" and now >= c["next"] and c["sent"] < len(TRICKLE):
            try:
                s.send(TRICKLE[c["sent"] : c["sent"] + 1])
                c["sent"] += 1
                trickled += 1
                c["next"] = now + t["trickle_s"]
            except BlockingIOError:
                pass
            except OSError:
                gone = True
        if gone:
            s.close()  # dropped by the server: open another at once
            dropped += 1
            entry[1] = one(addr, c["mode"])
print(json.dumps({"told": told, "opened": opened, "dropped": dropped, "trickled": trickled}), flush=True)
"""
"""The attacker: ``idle`` connections per server that never send a byte, ``trickle`` ones
that send the first bytes of a TLS handshake (``tls``) or of a blob frame header one at a time,
every ``trickle_s``; its last line says whether it was told to stop, the connections it
opened to each server, how many the servers dropped and the bytes it trickled."""


@dataclass(frozen=True)
class Flood:
    idle: int
    """Connections per server that never send anything."""
    trickle: int = 0
    """Connections per server that trickle a handshake (slowloris)."""
    trickle_s: float = 0.5
    tls: bool = True
    """The servers speak TLS (what the trickling connections send)."""

    def target(self, servers: list[str]) -> str:
        from digen.dataplane.wire import MAGIC

        return json.dumps(
            {
                "servers": servers,
                "idle": self.idle,
                "trickle": self.trickle,
                "trickle_s": self.trickle_s,
                "tls": self.tls,
                "magic": MAGIC.hex(),
                "give_up_s": GIVE_UP_S,
            }
        )


@dataclass
class Flooded:
    """What one flooded job did, and the attacker's own account of it."""

    iterations: int
    rows_before: int
    """Iterations of metrics.jsonl when the flood was in place (before the job went on)."""
    rows_after: int
    servers: list[str]
    """The blob servers flooded."""
    told: bool
    """The attacker was told to stop (the job had ended) before it gave up."""
    opened: dict[str, int]
    """Connections the attacker opened, per server (reopened ones counted)."""
    dropped: int
    trickled: int
    fired: list[dict] = field(default_factory=list, repr=False)
    """What fired of the job's faults, in order (:func:`digen.testing.faults.fired`): the hold,
    then what ``watch`` recorded."""

    def after_hold(self, point: str) -> list[dict]:
        """What fired at ``point`` after the hold (the flood was in place by then)."""
        hold = next(i for i, f in enumerate(self.fired) if f["action"] == "hold")
        return [f for f in self.fired[hold + 1 :] if f["point"] == point]

    @property
    def under_flood(self) -> int:
        """Iterations the job made while the flood held."""
        return self.rows_after - self.rows_before


Launch = Callable[[str, str], subprocess.Popen]
"""Starts the attacker's script with its one argument (``OtherUser.popen``, ``Namespace.popen``)."""
Targets = Callable[[Any, str], list[str]]
"""The blob servers to flood, from the job's Redis client and job id, once the job is held."""


def flooded_job(
    cfg: Config,
    out: Path,
    launch: Launch,
    flood: Flood,
    targets: Targets,
    *,
    scheduler: str | None = None,
    watch: tuple[Fault, ...] = (),
    prefix: str = "flood",
) -> Flooded:
    """Run ``cfg`` (disaggregated, ``max_staleness`` 0, one rollout worker ``rollout-0``) with
    the attacker on ``targets`` from the moment the rollout worker has weights version 1 to the
    job's end; raises if the job failed or did not end. ``watch``: ``signal`` faults armed
    after the hold, which record where the job got (a fetch, a weights version loaded)."""
    from digen.controlplane.redis_conn import connect
    from digen.runtime.controller import run_distributed
    from digen.testing.faults import arm, clear, fired

    job_id = f"{prefix}-{uuid.uuid4().hex[:8]}"
    errors: list[BaseException] = []
    with faults_on():
        r = connect(None)
        clear(r, job_id)
        # the rollout worker waits, once it has version 1, for the flood to be in place
        arm(r, job_id, Fault("sync", "hold", worker="rollout-0", iteration=1, flag=FLAG, seconds=GIVE_UP_S))
        arm(r, job_id, *watch)

        def run() -> None:
            try:
                run_distributed(cfg, out, job_id=job_id, scheduler=scheduler)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        job = threading.Thread(target=run, name="flooded-job", daemon=True)
        job.start()
        attacker = None
        try:
            held = lambda: any(f["point"] == "sync" for f in fired(r, job_id))  # noqa: E731
            deadline = 240.0
            while not held():
                assert job.is_alive(), f"the job ended before the hold: {errors}"
                job.join(timeout=0.2)
                deadline -= 0.2
                assert deadline > 0, "timed out waiting for the rollout worker's hold"
            servers = targets(r, job_id)
            assert servers, "no blob server to flood: the flood would prove nothing"
            attacker = launch(FLOOD, flood.target(servers))
            assert attacker.stdout is not None and attacker.stdout.readline().strip() == "ready", (
                attacker.stderr.read() if attacker.stderr else ""
            )
            rows_before = rows(out)
            r.sadd(f"digen:faults:{job_id}:flags", FLAG)  # the flood holds: go on
            job.join(timeout=GIVE_UP_S + 120)
            assert not job.is_alive(), "the job did not end"
            attacker.stdin.close()  # type: ignore[union-attr]
            attacker.wait(timeout=60)
            said, err = attacker.stdout.read(), attacker.stderr.read()  # type: ignore[union-attr]
            happened = fired(r, job_id)
        finally:
            r.sadd(f"digen:faults:{job_id}:flags", FLAG)
            if attacker is not None and attacker.poll() is None:
                attacker.kill()
                attacker.wait()
            job.join(timeout=60)
            clear(r, job_id)
            r.close()
    assert not errors, errors
    assert attacker.returncode == 0, err[-2000:]
    summary = json.loads(said.strip().splitlines()[-1])
    return Flooded(
        cfg.iterations,
        rows_before,
        rows(out),
        servers,
        summary["told"],
        summary["opened"],
        summary["dropped"],
        summary["trickled"],
        happened,
    )


def rows(out: Path) -> int:
    """Iterations the run directory's metrics.jsonl holds."""
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def bare(address: str) -> str:
    """``host:port`` of a blob server's address."""
    return address.split("://")[-1]
