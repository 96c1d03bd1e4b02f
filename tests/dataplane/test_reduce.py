"""Summing gradients: the exact fold is the reference's sum bit for bit; a trainer's running
sum and the all-reduce over trainers (real gloo processes) give every trainer the same bits."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket

import pytest
import torch

from digen.dataplane.reduce import TaskSum, all_reduce_sum, flatten, ordered_sum, unflatten
from digen.training import sum_gradients


def grads(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.lora_A": torch.randn(4, 8, generator=g), "a.lora_B": torch.randn(8, 4, generator=g) * 1e-3}


def test_ordered_sum_is_the_reference_loops_sum_bit_for_bit():
    parts = [grads(i) for i in range(5)]
    got, want = ordered_sum(iter(parts)), sum_gradients(parts)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert all(torch.equal(parts[0][k], grads(0)[k]) for k in want)  # the first part is not changed


def test_a_running_sum_in_task_order_is_the_ordered_sum_and_names_its_tasks():
    acc = TaskSum()
    for i in range(4):
        acc.add(f"train:0:{i}", grads(i))
    want = ordered_sum(grads(i) for i in range(4))
    assert acc.total is not None and all(torch.equal(acc.total[k], want[k]) for k in want)
    assert acc.tasks == ["train:0:0", "train:0:1", "train:0:2", "train:0:3"]
    acc.clear()
    assert acc.total is None and acc.tasks == []


def test_flatten_and_unflatten_round_trip_and_a_missing_sum_is_zeros():
    like = grads(0)
    names = sorted(like)
    flat = flatten(grads(1), names, like)
    assert flat.shape == (64,) and flat.dtype == torch.float32
    back = unflatten(flat, names, like)
    assert all(torch.equal(back[k], grads(1)[k]) for k in like)
    assert torch.equal(flatten(None, names, like), torch.zeros(64))


def _rank(rank: int, world: int, port: int, out) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    like = grads(0)
    names = sorted(like)
    mine = TaskSum()
    for i in range(rank, 6, world):  # tasks dealt round-robin to the trainers
        mine.add(f"t{i}", grads(i))
    flat = all_reduce_sum(flatten(mine.total, names, like))
    out.put((rank, flat.numpy().tobytes()))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.slow
def test_the_all_reduce_gives_every_trainer_the_same_bits_and_the_sum_within_float32_round_off(world):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, out)) for r in range(world)]
    env = os.environ.get("OMP_NUM_THREADS")
    for p in procs:
        p.start()
    got = dict(out.get(timeout=120) for _ in range(world))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert env == os.environ.get("OMP_NUM_THREADS")
    assert len(set(got.values())) == 1  # identical bytes on every rank: the replicas stay equal
    flat = torch.frombuffer(bytearray(got[0]), dtype=torch.float32)
    like = grads(0)
    exact = flatten(ordered_sum(grads(i) for i in range(6)), sorted(like), like)
    assert torch.allclose(flat, exact, rtol=0, atol=1e-6)


def test_a_trainers_running_sum_lives_on_its_parameters_device():
    """On a GPU trainer the tasks' gradients are added on the GPU (``meta`` stands in for it);
    a gradient fetched from a peer, on the host, is copied there. The exact sum folds a host
    part into a device one the same way."""
    like = {"a": torch.zeros(2, 3, device="meta"), "b": torch.zeros(4, device="meta")}
    host = {"a": torch.ones(2, 3), "b": torch.ones(4)}
    on_device = {k: torch.ones_like(v) for k, v in like.items()}
    for first, second in ((host, on_device), (on_device, host)):
        sums = TaskSum(like)
        sums.add("t0", first)
        sums.add("t1", second)
        assert sums.flat is not None and sums.flat.device.type == "meta"
        assert {v.device.type for v in sums.total.values()} == {"meta"}
    assert {v.device.type for v in ordered_sum([on_device, host], like=like).values()} == {"meta"}
    cpu = TaskSum({"a": torch.zeros(2, 3), "b": torch.zeros(4)})
    cpu.add("t0", host)
    cpu.add("t1", host)
    assert torch.equal(cpu.total["a"], torch.full((2, 3), 2.0))
