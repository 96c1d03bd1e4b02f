"""Small messages between the ranks of a trainer group, as JSON in uint8 tensors; and how a
group forms (:func:`join_process_group`).

``torch.distributed``'s object collectives (``broadcast_object_list``, ``all_gather_object``)
pickle their payloads; digen never unpickles anything that crossed a process boundary
(docs/architecture.md: payloads are JSON, msgpack or safetensors). These helpers send a JSON document as
its UTF-8 bytes, length first, over the group's own backend (gloo on CPU, NCCL on GPU: pass
the rank's device as ``device``).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import secrets
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from digen.task_records import TrainStats

log = logging.getLogger(__name__)

IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")

TRAINER_BACKEND_ENV = "DIGEN_TRAINER_BACKEND"
"""``gloo``: the replicated trainer group forms on gloo although its ranks compute on CUDA
(:func:`trainer_backend`); :data:`digen.cluster.placement.BACKEND_ENV` sets it."""


def _to_bytes(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)


def _from_bytes(t: torch.Tensor) -> Any:
    return json.loads(bytes(t.cpu().tolist()).decode())


def broadcast_json(obj: Any, *, src: int = 0, group=None, device: str | torch.device = "cpu") -> Any:
    """Every rank gets rank ``src``'s ``obj`` (a JSON-serialisable value; ignored elsewhere).
    A collective: every rank of ``group`` calls it."""
    is_src = dist.get_rank(group) == src
    payload = _to_bytes(obj).to(device) if is_src else None
    n = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.int64, device=device)
    dist.broadcast(n, group_src=src, group=group)
    buf = payload if payload is not None else torch.empty(int(n.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buf, group_src=src, group=group)
    return _from_bytes(buf)


def all_gather_json(obj: Any, *, group=None, device: str | torch.device = "cpu") -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank. A collective."""
    world = dist.get_world_size(group)
    mine = _to_bytes(obj).to(device)
    n = torch.tensor([mine.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n, group=group)
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: mine.numel()] = mine
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return [_from_bytes(p[: int(s.item())]) for p, s in zip(parts, sizes, strict=True)]


def all_reduce_stats(stats: TrainStats, *, group=None, device: str | torch.device = "cpu") -> TrainStats:
    """The group's :class:`TrainStats`: sums over every rank's rows (``ratio_max_dev``: the
    maximum). A collective."""
    sums = torch.tensor(
        [stats.rows, stats.loss, stats.approx_kl, stats.clipped, stats.kl], dtype=torch.float64, device=device
    )
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    peak = torch.tensor([stats.ratio_max_dev], dtype=torch.float64, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    rows, loss, approx_kl, clipped, kl = sums.tolist()
    # forwards: the ranks agreed on their count (one gather each), so every rank's is the group's
    return TrainStats(int(round(rows)), loss, approx_kl, clipped, kl, float(peak.item()), stats.forwards)


def join_process_group(
    *,
    leader: bool,
    host: str,
    rank: int,
    world: int,
    device: torch.device,
    timeout_s: float,
    publish: Callable[[dict], None],
    await_address: Callable[[], dict | None],
    store: Callable[[str, timedelta], dist.Store],
    backend: str | None = None,
) -> dict | None:
    """Form a group's ``torch.distributed`` process group through a rendezvous in Redis.

    The leader (rank 0) names a fresh formation (a random ``store`` name) and its backend
    (gloo on CPU, NCCL on CUDA) and ``publish``es them; the others ``await_address`` (None:
    give up, the job stopped or the leader left). Every rank then joins with
    ``init_process_group`` over ``store(name, timeout)``: a
    :class:`~digen.parallel.store.RedisStore` in the job's Redis, so the rendezvous opens no
    port (a ``TCPStore`` would answer anyone who reaches it). Returns the published address,
    or None when a rank gave up. The trainer group, the FSDP trainer group
    (:mod:`digen.workers.fsdp_loop`) and the sequence-parallel replicas (:mod:`digen.workers.sp_loop`)
    form their groups this way.

    Where the collectives listen: gloo's and NCCL's own sockets are pinned to the interface of
    ``host``, the rank's Dask worker host (127.0.0.1 in the embedded cluster;
    :func:`pin_interface`). They authenticate no peer: docs/deploy.md says how to isolate
    them. ``backend``: the leader's choice when given (:func:`trainer_backend`), else
    :func:`default_backend` of its device."""
    pin_interface(host)
    if leader:
        addr = {"host": host, "store": secrets.token_hex(8), "backend": backend or default_backend(device)}
        publish(addr)
    else:
        found = await_address()
        if found is None:
            return None
        addr = found
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=collective_timeout_s(addr["backend"], timeout_s))
    if addr["backend"] == "nccl":
        for var, value in NCCL_ENV.items():
            os.environ.setdefault(var, value)
    fresh_group_names()
    dist.init_process_group(
        addr["backend"], store=store(addr["store"], timeout), rank=rank, world_size=world, timeout=timeout
    )
    return addr


def fresh_group_names() -> None:
    """Name the next default group as every rank of a new formation names it: torch keys a
    group's rendezvous in the store under a per-process counter of the groups it began to form
    (``"<n>/..."``), reset when a group is destroyed but not when ``init_process_group``
    fails. A rank whose earlier formation failed (its peer hung past the timeout, or died in
    the rendezvous) would count one more than the others and wait for keys that no one writes:
    the group never forms again. Each formation meets in a store of its own (a fresh name), so
    restarting the count cannot mix two formations' keys. Nothing is done while a group is
    initialised."""
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized() and hasattr(c10d, "_world"):
        c10d._world.group_count = 0


NCCL_ENV = {"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
"""How an NCCL group fails, set before it forms (a value the operator set is kept):
``TORCH_NCCL_BLOCKING_WAIT=1``, a collective whose peer died raises in the thread that waits
on it once the group's timeout passes, as gloo's does (the trainer then aborts its step and
leaves the group: :meth:`digen.workers.trainer.Member.run_step`), instead of hanging until
NCCL's watchdog ends the process; ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``, the watchdog aborts
the group's communicators without taking the process down with them."""

NCCL_TIMEOUT_FRACTION = 0.5
"""An NCCL group's collective timeout, as a fraction of the job's ``schedule.lease_s``."""


def collective_timeout_s(backend: str, lease_s: float) -> float:
    """The collective timeout of a group on ``backend`` in a job whose task lease is
    ``lease_s``: gloo's is the lease; NCCL's half of it, so that a collective that waits on a
    dead peer fails (and its step aborts) while the tasks of the step are still leased,
    rather than after they were handed to another worker."""
    return lease_s * NCCL_TIMEOUT_FRACTION if backend == "nccl" else lease_s


def default_backend(device: torch.device) -> str:
    """NCCL on CUDA, gloo elsewhere."""
    return "nccl" if device.type == "cuda" else "gloo"


def trainer_backend(device: torch.device) -> str:
    """The replicated trainer group's backend: :func:`default_backend`, except gloo where the
    placement put two members on one GPU (``$DIGEN_TRAINER_BACKEND``, set by
    :mod:`digen.cluster.placement`), which NCCL refuses."""
    return "gloo" if os.environ.get(TRAINER_BACKEND_ENV) == "gloo" else default_backend(device)


def comm_device(backend: str, device: torch.device) -> torch.device:
    """Where a group's collective buffers live: the rank's device for NCCL, the host for gloo."""
    return device if backend == "nccl" else torch.device("cpu")


def interface_of(host: str) -> str | None:
    """The name of the network interface that holds address ``host`` (``lo`` for 127.0.0.1),
    or None when no interface of this machine holds it."""
    import psutil

    try:
        addr = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        try:
            addr = ipaddress.ip_address(socket.gethostbyname(host))
        except OSError:
            return None
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                try:
                    if ipaddress.ip_address(a.address.split("%")[0]) == addr:
                        return name
                except ValueError:
                    continue
    if addr.is_loopback:  # 127.0.0.2 and the like live on lo without being listed
        return next((n for n, s in psutil.net_if_stats().items() if n == "lo" and s.isup), None)
    return None


def pin_interface(host: str) -> None:
    """Make gloo and NCCL open their sockets on ``host``'s interface (``GLOO_SOCKET_IFNAME``,
    ``NCCL_SOCKET_IFNAME``), not on the interface this machine's host name resolves to. A
    value the operator set is kept. Read by the backends when a group is created."""
    name = interface_of(host)
    if name is None:
        log.debug("no interface holds %s: gloo and NCCL choose their own", host)
        return
    for var in IFNAME_VARS:
        os.environ.setdefault(var, name)
