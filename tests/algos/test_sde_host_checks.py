"""The SDE step checks its sigmas on the host: a step on a device (``meta`` stands in for
CUDA: it cannot be read back) whose sigmas are floats or CPU tensors never waits for the
device; the oracle tests in tests/trainer hold its values to the bits they had."""

from __future__ import annotations

import pytest
import torch

from digen.algos.sde import sde_step
from digen.errors import AlgorithmError


@pytest.mark.parametrize("kind", ["sde", "dance", "cps"])
def test_a_device_step_with_host_sigmas_reads_nothing_back(kind):
    x = torch.zeros(3, 4, 2, 2, device="meta")
    v = torch.zeros_like(x)
    for sigma, sigma_next in ((1.0, 0.75), (torch.tensor([0.9, 0.8, 1.0]), torch.tensor([0.7, 0.6, 0.8]))):
        step = sde_step(v, x, sigma, sigma_next, kind=kind, noise_level=0.7, sigma_max=0.95, prev_sample=x)
        assert step.log_prob.shape == (3,) and step.log_prob.device.type == "meta"


def test_host_checks_refuse_what_the_device_checks_refused():
    x = torch.zeros(2, 4)
    with pytest.raises(AlgorithmError, match="sigma_next < sigma"):
        sde_step(x, x, torch.tensor([0.5, 0.5]), torch.tensor([0.4, 0.5]), kind="dance", noise_level=0.5)
    with pytest.raises(AlgorithmError, match="0 < sigma <= 1"):
        sde_step(x, x, 1.5, 0.5, kind="sde", noise_level=0.5)
    with pytest.raises(AlgorithmError, match="pass sigma_max"):
        sde_step(x, x, 1.0, 0.5, kind="sde", noise_level=0.5)
    with pytest.raises(AlgorithmError, match="sigma_next < sigma"):  # a device-side sigma: one read-back
        sde_step(x, x, torch.tensor([0.5, 0.5]), torch.tensor([0.6, 0.4]), kind="sde", noise_level=0.5)
