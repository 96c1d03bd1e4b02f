"""A process group's collectives listen on the rank's own address only (gloo's and NCCL's
sockets on that address's interface), and its rendezvous opens no port at all (the ranks meet
in a store; in a job, :class:`~digen.parallel.store.RedisStore` in the job's Redis)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from digen.parallel import comm

from .conftest import Namespace

GROUP = r"""
import json, os, sys, psutil, torch
import torch.distributed as dist
from digen.parallel.comm import join_process_group

published = {}
join_process_group(
    leader=True, host=sys.argv[1], rank=0, world=1, device=torch.device("cpu"), timeout_s=30,
    publish=published.update, await_address=lambda: None, store=lambda name, timeout: dist.HashStore(),
)
t = torch.ones(3)
dist.all_reduce(t)  # the group works
me = psutil.Process()
listening = [c.laddr.ip for c in me.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
print(json.dumps({"published": published, "listening": listening, "sum": t.tolist(),
                  "ifnames": [os.environ.get("GLOO_SOCKET_IFNAME"), os.environ.get("NCCL_SOCKET_IFNAME")]}))
dist.destroy_process_group()
"""


def form_group(host: str) -> dict:
    """A one-rank gloo group formed by ``join_process_group`` on ``host``, in a fresh process."""
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    res = subprocess.run(
        [sys.executable, "-c", GROUP, host], capture_output=True, text=True, timeout=120, env=env
    )
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_rendezvous_and_gloo_listen_on_loopback_only():
    got = form_group("127.0.0.1")
    assert got["published"]["host"] == "127.0.0.1" and got["sum"] == [1.0, 1.0, 1.0]
    assert "port" not in got["published"] and got["published"]["store"]
    assert len(got["listening"]) >= 1, got  # gloo's pair listener; no store port
    assert set(got["listening"]) == {"127.0.0.1"}, got
    assert got["ifnames"] == ["lo", "lo"]


@pytest.mark.slow
def test_on_another_interface_they_listen_on_its_address_only(netns: Namespace):
    """Here this machine's host name resolves to loopback, so gloo left to itself would not
    use the veth pair: the address's interface is what pins it."""
    got = form_group(netns.host)
    assert set(got["listening"]) == {netns.host} and len(got["listening"]) >= 1, got
    name = comm.interface_of(netns.host)
    assert name is not None and name.startswith("dgs") and got["ifnames"] == [name, name]


def test_an_interface_the_operator_chose_is_kept(monkeypatch: pytest.MonkeyPatch):
    import os

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth-chosen")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "")  # recorded, so the value set below is undone
    monkeypatch.delenv("NCCL_SOCKET_IFNAME")
    comm.pin_interface("127.0.0.1")
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth-chosen" and os.environ["NCCL_SOCKET_IFNAME"] == "lo"
    assert comm.interface_of("127.0.0.1") == "lo" and comm.interface_of("203.0.113.77") is None


def test_a_worker_of_a_remote_scheduler_listens_on_the_interface_facing_it(netns: Namespace):
    """``digen worker`` without ``--host``: the local address that routes to the scheduler
    (found without sending anything), not every interface."""
    from digen.cluster.node import listen_host

    assert listen_host(f"tls://{netns.peer}:8786") == netns.host
