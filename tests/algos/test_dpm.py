"""DPM-Solver++(2M) steps equal the peers' solvers (float64, random tensors)."""

from __future__ import annotations

import math

import pytest
import torch

from digen.algos.dpm import dpm2_step, log_snr
from digen.algos.sde import euler_step

SIGMAS = torch.tensor([1.0, 0.94, 0.82, 0.63, 0.41, 0.2, 0.0], dtype=torch.float64)


def _alpha_sigma(s):
    return 1 - s, s


def peer_second_order(m0, m1, sigmas, i, sample):
    """NVlabs/DiffusionNFT solver.py ``multistep_dpm_solver_second_order_update`` (= MixGRPO
    sampling_utils.py's with ``dpmsolver++``, ``midpoint``, no noise), restated."""
    sigma_t, sigma_s0, sigma_s1 = sigmas[i + 1], sigmas[i], sigmas[i - 1]
    alpha_t, sigma_t = _alpha_sigma(sigma_t)
    alpha_s0, sigma_s0 = _alpha_sigma(sigma_s0)
    alpha_s1, sigma_s1 = _alpha_sigma(sigma_s1)
    lambda_t = torch.log(alpha_t) - torch.log(sigma_t)
    lambda_s0 = torch.log(alpha_s0) - torch.log(sigma_s0)
    lambda_s1 = torch.log(alpha_s1) - torch.log(sigma_s1)
    h, h_0 = lambda_t - lambda_s0, lambda_s0 - lambda_s1
    r0 = h_0 / h
    d0, d1 = m0, (1.0 / r0) * (m0 - m1)
    return (
        (sigma_t / sigma_s0) * sample
        - (alpha_t * (torch.exp(-h) - 1.0)) * d0
        - 0.5 * (alpha_t * (torch.exp(-h) - 1.0)) * d1
    )


def peer_ddim(m0, sigmas, i, sample):
    """DiffusionNFT solver.py ``ddim_update`` with eta 0 (its first and last steps)."""
    t, s = sigmas[i + 1], sigmas[i]
    noise_pred = (sample - (1 - s) * m0) / s
    return (1 - t) * m0 + t * noise_pred


def peer_run(v_fn, z):
    """DiffusionNFT ``run_sampling(solver="dpm2", determistic=True)``: step 0 and the last step
    first order (DDIM), second order in between."""
    x0_prev = None
    for i in range(len(SIGMAS) - 1):
        v = v_fn(z, i)
        m0 = z - SIGMAS[i] * v
        if i == 0 or i == len(SIGMAS) - 2:
            z = peer_ddim(m0, SIGMAS, i, z)
        else:
            z = peer_second_order(m0, x0_prev, SIGMAS, i, z)
        x0_prev = m0
    return z


def test_a_rollout_of_dpm2_steps_equals_the_peer_sampler():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3, 4, generator=gen, dtype=torch.float64)

    def v_fn(z, i):  # a smooth made-up velocity field, different at each sigma
        return torch.tanh(z @ w.T @ w * (1 + SIGMAS[i])) - z

    z0 = torch.randn(2, 3, 4, generator=gen, dtype=torch.float64)
    theirs = peer_run(v_fn, z0)
    x, prev = z0, None
    for i in range(len(SIGMAS) - 1):
        s, s_next = float(SIGMAS[i]), float(SIGMAS[i + 1])
        x, prev = dpm2_step(
            v_fn(x, i), x, s, s_next, prev_x0=prev, sigma_prev=float(SIGMAS[i - 1]) if i else None
        )
    assert float((x - theirs).abs().max()) < 1e-12
    assert float((x - theirs).abs().max()) < 1e-3 * float(theirs.abs().max())
    # and the second order matters: Euler all the way lands elsewhere
    e = z0
    for i in range(len(SIGMAS) - 1):
        e = euler_step(v_fn(e, i), e, float(SIGMAS[i]), float(SIGMAS[i + 1]))
    assert float((e - theirs).abs().max()) > 1e-3


def test_without_history_and_to_sigma_zero_it_is_the_euler_step():
    gen = torch.Generator().manual_seed(1)
    x, v, x0 = (torch.randn(2, 5, generator=gen, dtype=torch.float64) for _ in range(3))
    for s, s_next, prev in ((0.8, 0.5, None), (0.4, 0.0, x0)):
        out, x0_hat = dpm2_step(v, x, s, s_next, prev_x0=prev, sigma_prev=0.9)
        assert torch.equal(out, euler_step(v, x, s, s_next))
        assert torch.allclose(x0_hat, x - s * v, atol=0, rtol=0)
    # the first step after sigma = 1 is first order as well (lambda = -inf, r0 = inf)
    out, _ = dpm2_step(v, x, 0.9, 0.7, prev_x0=x0, sigma_prev=1.0)
    assert torch.allclose(out, euler_step(v, x, 0.9, 0.7), atol=1e-14, rtol=0)


def test_log_snr_and_argument_checks():
    assert log_snr(1.0) == -math.inf and log_snr(0.0) == math.inf and log_snr(0.5) == 0.0
    with pytest.raises(ValueError, match="sigma=1.5 must lie in"):
        log_snr(1.5)
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=r"sigma_next \(0.6\) < sigma \(0.5\)"):
        dpm2_step(x, x, 0.5, 0.6)
