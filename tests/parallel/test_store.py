"""The rendezvous store in the job's Redis (:class:`digen.parallel.store.RedisStore`): torch's
store semantics on a real embedded Redis, and two processes forming a gloo group through it
with no rendezvous port opened."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import redis
import torch.distributed as dist

from digen.controlplane.redis_conn import start_embedded, stop_embedded
from digen.parallel.store import RedisStore


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("store") / "digen.db"
    yield start_embedded(path)
    stop_embedded(path)


@pytest.fixture
def client(server) -> redis.Redis:
    r = redis.Redis(unix_socket_path=server.socket_path, password=server.password)
    r.flushdb()
    return r


def test_store_semantics(client: redis.Redis):
    s = RedisStore(client, "digen:j:tg:addr:3:store:ab:", timedelta(seconds=5), poll_s=0.001)
    s.set("a", b"\x00\x01")
    s.set("b", "text")
    assert s.get("a") == b"\x00\x01" and s.get("b") == b"text"
    assert client.get("digen:j:tg:addr:3:store:ab:a") == b"\x00\x01"  # under the formation's prefix
    assert s.add("n", 2) == 2 and s.add("n", 3) == 5
    assert s.check(["a", "b"]) and not s.check(["a", "missing"])
    assert s.compare_set("c", b"", b"first") == b"first"  # missing + empty expected: set
    assert s.compare_set("c", b"other", b"second") == b"first"  # mismatch: unchanged, the current value
    assert s.compare_set("c", b"first", b"second") == b"second"
    assert s.num_keys() == 4
    assert s.delete_key("c") and not s.delete_key("c")
    with pytest.raises(dist.DistStoreError, match="not set within"):
        s.wait(["never"], timedelta(milliseconds=50))
    s.set_timeout(timedelta(milliseconds=50))
    with pytest.raises(dist.DistStoreError):
        s.get("never")


GROUP = r"""
import json, sys
from datetime import timedelta
import psutil, redis, torch
import torch.distributed as dist
from digen.parallel.comm import join_process_group
from digen.parallel.store import RedisStore

rank, sock, password = int(sys.argv[1]), sys.argv[2], sys.argv[3] or None
r = redis.Redis(unix_socket_path=sock, password=password)
key = "digen:j:tg:addr:1"
def await_address():
    while r.get(key) is None:
        pass
    return json.loads(r.get(key))
addr = join_process_group(
    leader=rank == 0, host="127.0.0.1", rank=rank, world=2, device=torch.device("cpu"), timeout_s=60,
    publish=lambda a: r.set(key, json.dumps(a)), await_address=await_address,
    store=lambda name, timeout: RedisStore(r, f"{key}:store:{name}:", timeout),
)
t = torch.tensor([rank + 1.0])
dist.all_reduce(t)
listening = [c.laddr.ip for c in psutil.Process().net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
dist.barrier()
print(json.dumps({"sum": t.item(), "addr": addr, "listening": listening}))
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_two_processes_form_a_gloo_group_through_redis(server, client: redis.Redis, tmp_path: Path):
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", GROUP, str(rank), server.socket_path, server.password or ""],
            stdout=subprocess.PIPE,
            stderr=open(tmp_path / f"rank{rank}.err", "w"),  # noqa: SIM115 - closed with the process
            text=True,
        )
        for rank in range(2)
    ]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    for rank, p in enumerate(procs):
        assert p.returncode == 0, (tmp_path / f"rank{rank}.err").read_text()[-2000:]
    got = [json.loads(o.strip().splitlines()[-1]) for o in outs]
    assert [g["sum"] for g in got] == [3.0, 3.0]
    assert got[0]["addr"] == got[1]["addr"] and "port" not in got[0]["addr"]
    # the ranks met in Redis: the formation's keys are there, and each rank listens only for
    # gloo's pairs, on loopback (no store port)
    name = got[0]["addr"]["store"]
    assert any(client.scan_iter(match=f"digen:j:tg:addr:1:store:{name}:*"))
    assert all(set(g["listening"]) == {"127.0.0.1"} for g in got), got
