"""A rank of the dead-peer test (tests/parallel/test_dead_peer.py): both ranks form a gloo group
the way digen's groups form (:func:`digen.parallel.comm.join_process_group`, the rendezvous in
files here instead of Redis), all-reduce once, then rank 1 waits to be killed or stopped while
rank 0 all-reduces again and writes what that collective did. Lives outside the test module so
spawned processes import only this."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from digen.parallel import comm


def _write(folder: Path, name: str, value: dict) -> None:
    tmp = folder / f".{name}"
    tmp.write_text(json.dumps(value))
    tmp.rename(folder / name)  # whole, or not there


def _address(folder: Path, deadline: float) -> dict | None:
    while time.monotonic() < deadline:
        if (folder / "address").exists():
            return json.loads((folder / "address").read_text())
        time.sleep(0.05)  # polling for the leader's file, as the Redis rendezvous polls its key
    return None


def _store(folder: Path, world: int):
    def make(name: str, timeout):
        store = dist.FileStore(str(folder / f"store-{name}"), world)
        store.set_timeout(timeout)
        return store

    return make


def run_rank(rank: int, world: int, folder_s: str, timeout_s: float) -> None:
    folder = Path(folder_s)
    comm.join_process_group(
        leader=rank == 0,
        host="127.0.0.1",
        rank=rank,
        world=world,
        device=torch.device("cpu"),
        timeout_s=timeout_s,
        publish=lambda addr: _write(folder, "address", addr),
        await_address=lambda: _address(folder, time.monotonic() + 120),
        store=_store(folder, world),
    )
    t = torch.ones(4)
    dist.all_reduce(t)  # the group works: both ranks took part
    if rank != 0:
        _write(folder, f"ready-{rank}", {"sum": t.tolist()})
        signal.pause()  # until the test kills or stops this process
        return
    _write(folder, "entering", {"sum": t.tolist()})
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1 << 20))
    except Exception as exc:  # what Member.run_step catches to abort its step
        result = {"raised": type(exc).__name__, "message": str(exc)[:300], "elapsed_s": time.monotonic() - t0}
    else:
        result = {"raised": None, "elapsed_s": time.monotonic() - t0}
    # then the member leaves the broken group, as Member.leave_group does, and forms the next
    try:
        dist.destroy_process_group()
        result["destroyed"] = "ok"
    except Exception as exc:  # noqa: BLE001 - reported
        result["destroyed"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    result["initialized_after"] = dist.is_initialized()
    _write(folder, "result", result)
