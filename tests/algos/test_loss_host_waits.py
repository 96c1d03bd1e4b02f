"""A training forward's loss reads nothing back from the device: the noiseless-row checks of
GRPO-Guard and Flow-DPPO read host values only (``meta`` stands in for CUDA: it cannot be read
back, so a read-back raises), the noise level they need is refused in the config instead, and a
task's statistics come back in one transfer, to the bits one transfer per forward gave."""

from __future__ import annotations

import pytest
import torch

from digen.algos.flow_dppo import divergence_masked_loss
from digen.algos.grpo_guard import guard_ratio_loss
from digen.algos.loss import LossTerms
from digen.config import build_config
from digen.errors import AlgorithmError, ConfigError
from digen.task_records import TrainStats
from tests.conftest import required


def _device_rows(n=3, device="meta"):
    z = torch.zeros(n, device=device)
    mean = torch.zeros(n, 4, device=device)
    return z, mean


def test_guard_and_dppo_losses_on_a_device_read_nothing_back():
    z, mean = _device_rows()
    host_dt = torch.tensor([0.1, 0.1, 0.2])
    terms = guard_ratio_loss(z, z, mean, mean, z + 1, host_dt, z, 0.2)
    assert terms.loss.device.type == "meta"
    terms = divergence_masked_loss(z, z, mean, mean, z + 1, z, 1e-5)
    assert terms.loss.device.type == "meta"


def test_host_rows_without_noise_are_still_refused():
    z, mean = _device_rows(device="cpu")
    with pytest.raises(AlgorithmError, match="GRPO-Guard needs stochastic steps \\(dt > 0"):
        guard_ratio_loss(z, z, mean, mean, z + 1, torch.tensor([0.1, 0.0, 0.1]), z, 0.2)
    with pytest.raises(AlgorithmError, match="GRPO-Guard needs stochastic steps \\(transition std"):
        guard_ratio_loss(z, z, mean, mean, z, torch.full((3,), 0.1), z, 0.2)
    with pytest.raises(AlgorithmError, match="Flow-DPPO needs stochastic steps"):
        divergence_masked_loss(z, z, mean, mean, z, z, 1e-5)


@pytest.mark.parametrize("algorithm", ["grpo-guard", "flow-dppo"])
def test_an_euler_rollout_is_refused_before_anything_trains(algorithm):
    data = required(
        {"train": {"algorithm": algorithm}, "rollout": {"sde": {"kind": "sde", "noise_level": 0.0}}}
    )
    with pytest.raises(ConfigError, match="rollout.sde.noise_level must be > 0"):
        build_config(data, check_paths=False)
    data["rollout"]["sde"]["noise_level"] = 0.7
    assert build_config(data, check_paths=False).train.algorithm == algorithm


def _terms(g, n, dtype):
    loss = torch.randn(n, generator=g, dtype=dtype)
    ratio = 1 + 0.1 * torch.randn(n, generator=g, dtype=dtype)
    return loss, LossTerms(loss=loss, ratio=ratio, clipped=ratio > 1.05, approx_kl=loss.abs()), loss * 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_one_read_back_per_task_gives_the_bits_of_one_per_forward(dtype):
    g = torch.Generator().manual_seed(3)
    forwards = [(n, *_terms(g, n, dtype)) for n in (5, 1, 7, 3)]
    batched = TrainStats()
    batched.add_chunks(
        [n for n, *_ in forwards], [TrainStats.chunk_sums(loss, t, k) for _, loss, t, k in forwards]
    )
    alone = TrainStats()
    for n, loss, terms, kl in forwards:  # the per-forward reading: each sum read on its own
        alone.rows += n
        alone.forwards += 1
        alone.loss += loss.sum().item()
        alone.approx_kl += terms.approx_kl.sum().item()
        alone.clipped += terms.clipped.float().sum().item()
        alone.kl += kl.sum().item()
        alone.ratio_max_dev = max(alone.ratio_max_dev, (terms.ratio - 1).abs().max().item())
    assert batched == alone
    assert batched.forwards == 4 and batched.rows == 16
