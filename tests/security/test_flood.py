"""Idle connections from another local user do not starve a job: while ``nobody`` holds 32
connections to every trainer's blob server that never authenticate (opening a new one for each
the server drops), the job fetches every weights version it needs and finishes its iterations.

Before the blob server's authentication deadline and identity caps, 32 such connections (16
per blob server were enough: every loopback peer is 127.0.0.1, so the per-address cap was
everyone's) stopped training for as long as they were held. The test decides from the order
of events: the job ended before the attacker was told to stop, with iterations made after the
flood was in place; against the old server the job stalls until the attacker gives up.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import uuid
from pathlib import Path

import pytest

from tests.conftest import faults_on
from tests.reliability.conftest import fault_config

from .conftest import OtherUser

pytestmark = pytest.mark.slow  # one job of 5 iterations on 2 worker processes

FLAG = "flooded"
PER_SERVER = 32
GIVE_UP_S = 240
"""How long the attacker holds at most: past it the job would have stalled (a hang guard)."""

FLOOD = r"""
import json, os, select, socket, sys, time
t = json.loads(sys.argv[1])
servers = [(a.split("://")[-1].rsplit(":", 1)[0], int(a.rsplit(":", 1)[1])) for a in t["servers"]]

def one(addr):
    try:
        s = socket.create_connection(addr, timeout=5)
    except OSError:  # the server is gone (the job ended): nothing left to hold
        return None
    s.setblocking(False)
    return s

held = {a: [one(a) for _ in range(t["per"])] for a in servers}
opened, dropped = sum(s is not None for socks in held.values() for s in socks), 0
print("ready", flush=True)
start, told = time.monotonic(), False
while time.monotonic() - start < t["give_up_s"]:
    if select.select([sys.stdin], [], [], 0.05)[0]:  # the test closed our stdin: stop
        told = True
        break
    for addr, socks in held.items():
        for i, s in enumerate(socks):
            if s is None:
                continue
            try:
                if s.recv(4096) != b"":
                    continue  # whatever the server says first; we never answer
            except BlockingIOError:
                continue
            except OSError:
                pass
            s.close()  # dropped by the server: open another at once
            dropped += 1
            socks[i] = one(addr)
            opened += socks[i] is not None
print(json.dumps({"told": told, "opened": opened, "dropped": dropped}), flush=True)
"""


def test_another_users_idle_flood_does_not_stop_the_job(
    tiny_sd3: Path, tmp_path: Path, other_user: OtherUser
):
    from digen.controlplane.redis_conn import connect
    from digen.controlplane.trainer_group import TrainerGroup
    from digen.runtime.controller import run_distributed
    from digen.testing.faults import Fault, arm, clear, fired

    iterations = 5
    cfg = fault_config(
        tiny_sd3,
        iterations=iterations,
        schedule={"mode": "disaggregated", "max_staleness": 0},  # every iteration fetches a version
        cluster__local={"rollout_workers": 1, "trainer_workers": 1},
    )
    job_id = f"flood-{uuid.uuid4().hex[:8]}"
    out = tmp_path / "run"
    errors: list[BaseException] = []
    with faults_on():
        r = connect(None)
        clear(r, job_id)
        # the rollout worker waits, once it has version 1, for the flood to be in place
        arm(r, job_id, Fault("sync", "hold", worker="rollout-0", iteration=1, flag=FLAG, seconds=GIVE_UP_S))

        def run() -> None:
            try:
                run_distributed(cfg, out, job_id=job_id)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        job = threading.Thread(target=run, name="flooded-job", daemon=True)
        job.start()
        attacker = None
        try:
            held = lambda: any(f["point"] == "sync" for f in fired(r, job_id))  # noqa: E731
            deadline = 240
            while not held():
                assert job.is_alive(), f"the job ended before the hold: {errors}"
                job.join(timeout=0.2)
                deadline -= 0.2
                assert deadline > 0, "timed out waiting for the rollout worker's hold"
            servers = TrainerGroup(r, job_id).holders_of(1)
            assert servers, "no trainer serves version 1: the flood would prove nothing"
            target = {"servers": servers, "per": PER_SERVER, "give_up_s": GIVE_UP_S}
            attacker = subprocess.Popen(
                [
                    shutil.which("runuser") or "/usr/sbin/runuser",
                    "-u",
                    other_user.name,
                    "--",
                    *other_user.argv,
                    "-c",
                    FLOOD,
                    json.dumps(target),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd="/",
                env=other_user.env,
            )
            assert attacker.stdout is not None and attacker.stdout.readline().strip() == "ready", (
                attacker.stderr.read() if attacker.stderr else ""
            )
            rows_before = _rows(out)
            r.sadd(f"digen:faults:{job_id}:flags", FLAG)  # the flood holds: go on
            job.join(timeout=GIVE_UP_S + 120)
            assert not job.is_alive(), "the job did not end"
            attacker.stdin.close()  # type: ignore[union-attr]
            attacker.wait(timeout=60)
            said, err = attacker.stdout.read(), attacker.stderr.read()  # type: ignore[union-attr]
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
    assert summary["told"], f"the job ended only after the flood gave up: {summary} {err[-500:]}"
    assert summary["opened"] >= PER_SERVER * len(servers)
    assert rows_before <= 1 and _rows(out) == iterations  # 3 or more iterations under the flood


def _rows(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0
