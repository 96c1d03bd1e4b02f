"""How a group forms its ``torch.distributed`` process group: the backend the leader names
and the collective timeout. NCCL groups time out well inside the task lease and raise in the
waiting thread (gloo's semantics, which the step's abort path expects); no NCCL here, so the
settings handed to ``init_process_group`` are what is checked, and a gloo group forms for real."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from digen.parallel import comm


def _join(backend: str | None, monkeypatch, calls: list | None = None) -> dict:
    for var in comm.IFNAME_VARS:  # pinned by the join: given back unset after the test
        monkeypatch.delenv(var, raising=False)
    if calls is not None:
        monkeypatch.setattr(dist, "init_process_group", lambda b, **kw: calls.append((b, kw)))
    published: dict = {}
    addr = comm.join_process_group(
        leader=True,
        host="127.0.0.1",
        rank=0,
        world=1,
        device=torch.device("cpu"),
        timeout_s=120.0,
        publish=published.update,
        await_address=lambda: None,
        store=lambda name, timeout: dist.HashStore(),
        backend=backend,
    )
    assert addr == published
    return addr


def test_an_nccl_group_times_out_inside_the_lease_and_raises_where_it_waits(monkeypatch):
    for var in comm.NCCL_ENV:
        monkeypatch.delenv(var, raising=False)
    calls: list = []
    addr = _join("nccl", monkeypatch, calls)
    ((backend, kw),) = calls
    assert addr["backend"] == backend == "nccl"
    assert kw["timeout"] == timedelta(seconds=60) < timedelta(seconds=120)  # the lease
    assert {v: os.environ.get(v) for v in comm.NCCL_ENV} == {
        "TORCH_NCCL_BLOCKING_WAIT": "1",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    }


def test_a_gloo_group_keeps_the_lease_as_its_timeout_and_no_nccl_setting(monkeypatch):
    for var in comm.NCCL_ENV:
        monkeypatch.delenv(var, raising=False)
    calls: list = []
    _join(None, monkeypatch, calls)  # a CPU rank: gloo
    ((backend, kw),) = calls
    assert backend == "gloo" and kw["timeout"] == timedelta(seconds=120)
    assert not any(v in os.environ for v in comm.NCCL_ENV)


@pytest.mark.parametrize("lease", [10.0, 120.0, 600.0])
def test_the_collective_timeout_is_shorter_than_the_lease_on_nccl_only(lease):
    assert comm.collective_timeout_s("nccl", lease) < lease
    assert comm.collective_timeout_s("gloo", lease) == lease


def test_a_real_gloo_group_forms_with_those_settings(monkeypatch):
    _join(None, monkeypatch)
    try:
        t = torch.ones(2)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0] and dist.get_backend() == "gloo"
    finally:
        dist.destroy_process_group()


def test_a_failed_formation_does_not_change_the_names_of_the_next_group(monkeypatch):
    """A rank whose last formation failed (its peer never came within the timeout) names its
    next group as a rank that never failed does: the same store keys, so the group forms."""
    from torch.distributed import distributed_c10d as c10d

    for var in comm.IFNAME_VARS:
        monkeypatch.delenv(var, raising=False)

    def join(world: int, timeout_s: float) -> None:
        comm.join_process_group(
            leader=True,
            host="127.0.0.1",
            rank=0,
            world=world,
            device=torch.device("cpu"),
            timeout_s=timeout_s,
            publish=lambda addr: None,
            await_address=lambda: None,
            store=lambda name, timeout: dist.HashStore(),
        )

    with pytest.raises(dist.DistStoreError):
        join(2, 0.5)  # rank 1 never comes
    assert not dist.is_initialized() and c10d._world.group_count == 1  # torch counted the failed one
    join(1, 30.0)
    try:
        assert dist.distributed_c10d._get_default_group().group_name == "0"  # as a rank that never failed
    finally:
        dist.destroy_process_group()
