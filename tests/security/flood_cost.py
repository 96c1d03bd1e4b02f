"""What a flood costs a job's speed: a measurement, not a test of the suite (its name is no
``test_*.py``, so ``make test`` never collects it). The table of docs/dataplane.md ("A server
that survives abuse") comes from it::

    PYTHONPATH=$PWD .venv/bin/python -m pytest -q -s -p no:cacheprovider tests/security/flood_cost.py

The job of ``tests/security/test_flood.py`` (tiny SD3, disaggregated, one rollout worker and
one trainer, ``max_staleness`` 0) with ``FLOOD_ITERATIONS`` iterations (12), attacked by
another local user (``nobody``) on the rollout worker's blob server from iteration 1 on, by
each attack of :data:`ATTACKS` in turn, ``FLOOD_ROUNDS`` rounds (3) interleaved so that a
change of the machine's load falls on every attack alike. Per job: the mean ``wall_s`` of
``metrics.jsonl`` over iterations 2 to the last but one (every one of them wholly under the
attack; the last, which also ends the job, left out), and the attacker's connections the server dropped per second of the iterations made
under attack (each one dropped is opened again at once). Prints one JSON line per job, then the table; with
``FLOOD_OUT`` set, writes the lines there too.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .conftest import OtherUser
from .flood import Flood, flooded_job
from .test_flood import job_config, rollout_servers

ATTACKS = {
    "none": Flood(idle=0),
    "32 idle + 16 trickling": Flood(idle=32, trickle=16),
    "48 idle + 32 trickling": Flood(idle=48, trickle=32),
}


def seconds_per_iteration(out: Path) -> float:
    """Mean ``wall_s`` over iterations 2 .. N-2 of the run's metrics.jsonl."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return statistics.fmean(r["wall_s"] for r in rows[2:-1])


def test_flood_cost(tiny_sd3: Path, tmp_path: Path, other_user: OtherUser):
    rounds = int(os.environ.get("FLOOD_ROUNDS", "3"))
    iterations = int(os.environ.get("FLOOD_ITERATIONS", "12"))
    cfg = job_config(tiny_sd3, iterations=iterations)
    results: dict[str, list[float]] = {name: [] for name in ATTACKS}
    lines = []
    for k in range(rounds):
        for name, flood in ATTACKS.items():
            out = tmp_path / f"r{k}-{len(results[name])}-{flood.idle}-{flood.trickle}"
            got = flooded_job(cfg, out, other_user.popen, flood, rollout_servers, prefix="cost")
            assert got.told and got.rows_after == iterations, got
            s = seconds_per_iteration(out)
            results[name].append(s)
            rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            attacked_s = sum(r["wall_s"] for r in rows[got.rows_before :])
            line = {
                "round": k,
                "attack": name,
                "s_per_iteration": round(s, 3),
                "opened": sum(got.opened.values()),
                "dropped": got.dropped,
                "dropped_per_s": round(got.dropped / attacked_s, 1),
                "load": os.getloadavg()[0],
            }
            lines.append(json.dumps(line))
            print(lines[-1], flush=True)
    if os.environ.get("FLOOD_OUT"):
        Path(os.environ["FLOOD_OUT"]).write_text("\n".join(lines) + "\n")
    none = results["none"]
    print("\n| attack on the server | s per iteration | against none |\n|---|---|---|")
    for name, got_s in results.items():
        against = (
            "" if name == "none" else ", ".join(f"{s / n - 1:+.0%}" for s, n in zip(got_s, none, strict=True))
        )
        print(f"| {name} | {', '.join(f'{s:.2f}' for s in got_s)} | {against} |")


SERVER = r"""
import json, sys
from digen.dataplane.blobs import BlobServer, BlobStore, tls_contexts
server_ctx, _ = tls_contexts(*sys.argv[1:4])
server = BlobServer(BlobStore(), ssl_context=server_ctx)
print(server.address, flush=True)
sys.stdin.read()  # until the parent closes it
print(json.dumps(dict(server.counts)), flush=True)
"""
"""A blob server over TLS, alone in a process: prints its address, serves until its stdin
closes, then prints its counts."""


def cpu_s(pid: int) -> float:
    """User and system seconds process ``pid`` has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_server_cpu_under_a_flood(tmp_path: Path):
    """The server's own cost: a TLS blob server alone in a process, ``FLOOD_CPU_S`` seconds (10)
    under each attack of :data:`ATTACKS` from an attacker process (this user: the cost is the
    server's, whoever attacks), ``FLOOD_ROUNDS`` rounds; CPU seconds a second of the server's
    process (from /proc), and the connections it dropped a second."""
    from tests.reliability.certs import make_certs

    from .flood import FLOOD

    certs = make_certs(tmp_path / "certs")
    seconds = float(os.environ.get("FLOOD_CPU_S", "10"))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    results: dict[str, list[float]] = {name: [] for name in ATTACKS}
    for _ in range(int(os.environ.get("FLOOD_ROUNDS", "3"))):
        for name, flood in ATTACKS.items():
            server = subprocess.Popen(
                [sys.executable, "-c", SERVER, str(certs.ca), str(certs.cert), str(certs.key)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
            )  # fmt: skip
            address = server.stdout.readline().strip()
            attacker = subprocess.Popen(
                [sys.executable, "-c", FLOOD, flood.target([address])],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            assert attacker.stdout.readline().strip() == "ready"
            start = cpu_s(server.pid)
            time.sleep(seconds)  # the measurement's window: the attack runs meanwhile
            used = cpu_s(server.pid) - start
            attacker.stdin.close()
            said = json.loads(attacker.stdout.read().strip().splitlines()[-1])
            attacker.wait(timeout=60)
            server.stdin.close()
            counts = json.loads(server.stdout.read().strip().splitlines()[-1])
            server.wait(timeout=60)
            results[name].append(used / seconds)
            line = {"attack": name, "cpu_per_s": round(used / seconds, 4), "dropped": said["dropped"],
                    "dropped_per_s": round(said["dropped"] / seconds, 1), "counts": counts}  # fmt: skip
            print(json.dumps(line), flush=True)
    print("\n| attack on a lone TLS server | CPU s a second |\n|---|---|")
    for name, got in results.items():
        print(f"| {name} | {', '.join(f'{c:.3f}' for c in got)} |")
