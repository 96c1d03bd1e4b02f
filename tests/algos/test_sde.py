"""digen.algos.sde against the formulas of algorithms.md, computed independently here."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributions import Normal

from digen.algos import euler_step, kl_to_reference, sde_step
from digen.errors import DigenError

SHAPE = (3, 4, 5, 6)


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(velocity, sample) [3, 4, 5, 6] float32."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g), torch.randn(SHAPE, generator=g)


@pytest.mark.parametrize("kind, a", [("sde", 0.7), ("dance", 0.3)])
def test_gaussian_log_prob_matches_torch_normal(kind: str, a: float) -> None:
    v, x = _inputs()
    sigma, sigma_next = 0.6, 0.45
    dt = sigma_next - sigma
    out = sde_step(
        v, x, sigma, sigma_next, kind=kind, noise_level=a, generator=torch.Generator().manual_seed(1)
    )

    std_dev_t = a * math.sqrt(sigma / (1 - sigma)) if kind == "sde" else a
    s_t = std_dev_t * math.sqrt(-dt)
    # Flow-GRPO's factored form of the same mean, written differently on purpose.
    c = std_dev_t**2 / (2 * sigma)
    mean = x * (1 + c * dt) + v * (1 + c * (1 - sigma)) * dt
    torch.testing.assert_close(out.mean, mean, rtol=1e-5, atol=1e-6)

    expected = Normal(out.mean, s_t).log_prob(out.prev_sample).mean(dim=(1, 2, 3))
    torch.testing.assert_close(out.log_prob, expected, rtol=1e-6, atol=1e-6)
    assert out.log_prob.shape == (3,)
    torch.testing.assert_close(out.std, torch.full((3,), std_dev_t))
    torch.testing.assert_close(out.transition_std, torch.full((3,), s_t))


def test_cps_log_prob_is_unnormalised_squared_error() -> None:
    v, x = _inputs()
    sigma, sigma_next, a = 0.6, 0.45, 0.8
    eps = torch.randn(SHAPE, generator=torch.Generator().manual_seed(2))
    out = sde_step(v, x, sigma, sigma_next, kind="cps", noise_level=a, noise=eps)

    std = sigma_next * math.sin(a * math.pi / 2)
    mean = (x - sigma * v) * (1 - sigma_next) + (x + (1 - sigma) * v) * sigma_next * math.cos(a * math.pi / 2)
    torch.testing.assert_close(out.mean, mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.prev_sample, out.mean + std * eps)
    by_hand = -((out.prev_sample - out.mean) ** 2).mean(dim=(1, 2, 3))
    torch.testing.assert_close(out.log_prob, by_hand)
    torch.testing.assert_close(out.std, torch.full((3,), std))


@pytest.mark.parametrize("kind", ["sde", "dance"])
def test_noise_level_zero_is_the_euler_step(kind: str) -> None:
    v, x = _inputs()
    out = sde_step(v, x, 1.0, 0.8, kind=kind, noise_level=0.0)  # no sigma_max needed without noise
    dt = torch.tensor(0.8) - torch.tensor(1.0)  # float32 arithmetic, as the step does
    assert torch.equal(out.prev_sample, x + v * dt)
    assert torch.equal(out.prev_sample, euler_step(v, x, 1.0, 0.8))
    assert torch.isnan(out.log_prob).all() and out.log_prob.shape == (3,)


def test_cps_noise_level_zero_is_euler_up_to_rounding() -> None:
    v, x = _inputs()
    out = sde_step(v, x, 0.6, 0.45, kind="cps", noise_level=0.0)
    torch.testing.assert_close(out.prev_sample, euler_step(v, x, 0.6, 0.45), rtol=1e-5, atol=1e-6)
    assert torch.equal(out.log_prob, torch.zeros(3))


@pytest.mark.parametrize("kind", ["sde", "cps", "dance"])
def test_rescoring_the_drawn_sample_gives_ratio_exactly_one(kind: str) -> None:
    v, x = _inputs()
    sigma = torch.tensor([0.9, 0.5, 0.2])
    sigma_next = torch.tensor([0.8, 0.3, 0.0])
    out = sde_step(v, x, sigma, sigma_next, kind=kind, generator=torch.Generator().manual_seed(3))
    again = sde_step(v, x, sigma, sigma_next, kind=kind, prev_sample=out.prev_sample)
    assert torch.equal(again.log_prob, out.log_prob)
    assert torch.equal(torch.exp(again.log_prob - out.log_prob), torch.ones(3))
    assert torch.isfinite(out.log_prob).all()


def test_sigma_one_uses_sigma_max_in_the_denominator() -> None:
    v, x = _inputs()
    with pytest.raises(ValueError, match="sigma_max"):
        sde_step(v, x, 1.0, 0.9, kind="sde", noise_level=0.7)
    with pytest.raises(DigenError):
        sde_step(v, x, 1.0, 0.9, kind="sde", noise_level=0.7)

    out = sde_step(v, x, 1.0, 0.9, kind="sde", noise_level=0.7, sigma_max=0.9, noise=torch.zeros(SHAPE))
    std_dev_t = 0.7 * math.sqrt(1.0 / (1 - 0.9))  # sigma stays 1 in the numerator
    torch.testing.assert_close(out.std, torch.full((3,), std_dev_t))
    mean = x - 0.1 * v + (std_dev_t**2 / 2) * x * -0.1  # (1 - sigma) * v vanishes at sigma == 1
    torch.testing.assert_close(out.mean, mean, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["sde", "cps", "dance"])
def test_per_row_sigmas_equal_rows_run_separately(kind: str) -> None:
    v, x = _inputs()
    sigmas = [1.0, 0.7, 0.3]
    nexts = [0.9, 0.5, 0.0]
    eps = torch.randn(SHAPE, generator=torch.Generator().manual_seed(4))
    batched = sde_step(v, x, torch.tensor(sigmas), torch.tensor(nexts), kind=kind, noise=eps, sigma_max=0.9)
    for i, (s, n) in enumerate(zip(sigmas, nexts, strict=True)):
        row = sde_step(v[i : i + 1], x[i : i + 1], s, n, kind=kind, noise=eps[i : i + 1], sigma_max=0.9)
        torch.testing.assert_close(batched.prev_sample[i : i + 1], row.prev_sample)
        torch.testing.assert_close(batched.log_prob[i : i + 1], row.log_prob)
        torch.testing.assert_close(batched.std[i : i + 1], row.std)


def test_generator_noise_is_reproducible_and_equals_explicit_noise() -> None:
    v, x = _inputs()
    a = sde_step(v, x, 0.6, 0.4, generator=torch.Generator().manual_seed(5))
    b = sde_step(v, x, 0.6, 0.4, generator=torch.Generator().manual_seed(5))
    eps = torch.randn(SHAPE, generator=torch.Generator().manual_seed(5))
    c = sde_step(v, x, 0.6, 0.4, noise=eps)
    assert torch.equal(a.prev_sample, b.prev_sample)
    assert torch.equal(a.prev_sample, c.prev_sample)
    d = sde_step(v, x, 0.6, 0.4, generator=torch.Generator().manual_seed(6))
    assert not torch.equal(a.prev_sample, d.prev_sample)


def test_computes_in_float32_and_log_prob_differentiates_the_mean_only() -> None:
    v, x = _inputs()
    v64 = v.double().requires_grad_(True)
    out = sde_step(v64, x.to(torch.bfloat16), 0.6, 0.4, generator=torch.Generator().manual_seed(7))
    assert out.prev_sample.dtype == out.log_prob.dtype == out.mean.dtype == torch.float32
    # The drawn sample depends on v through the mean; the density must treat it as data (detached),
    # otherwise x_next - mean = s_t * eps and log_prob would have no gradient at all.
    out.log_prob.sum().backward()
    assert v64.grad is not None and v64.grad.abs().sum() > 0


def test_a_float64_sample_keeps_float64() -> None:
    """``model.dtype: float64`` (numerical checks): the step, its log-prob and the KL stay in
    float64, and equal the float32 step to float32 precision."""
    v, x = _inputs()
    eps = torch.randn(SHAPE, generator=torch.Generator().manual_seed(5))
    for kind in ("sde", "cps", "dance"):
        lo = sde_step(v, x, 0.6, 0.4, kind=kind, noise=eps)
        hi = sde_step(v.double(), x.double(), 0.6, 0.4, kind=kind, noise=eps)
        fields = (hi.prev_sample, hi.log_prob, hi.mean, hi.std, hi.transition_std)
        assert all(t.dtype == torch.float64 for t in fields)
        torch.testing.assert_close(hi.log_prob.float(), lo.log_prob, rtol=1e-5, atol=1e-5)
        assert kl_to_reference(hi.mean, hi.mean.detach() + 1, hi.std).dtype == torch.float64


def test_kl_to_reference_by_hand() -> None:
    mean = torch.tensor([[1.0, 3.0], [0.0, 0.0]])
    ref = torch.tensor([[0.0, 1.0], [0.0, 2.0]])
    std = torch.tensor([0.5, 2.0])
    # row 0: mean(1, 4) / (2 * 0.25) = 2.5 / 0.5 = 5; row 1: mean(0, 4) / (2 * 4) = 2 / 8 = 0.25
    torch.testing.assert_close(kl_to_reference(mean, ref, std), torch.tensor([5.0, 0.25]))
    assert torch.equal(kl_to_reference(mean, mean, 0.7), torch.zeros(2))


def test_bad_inputs_are_named() -> None:
    v, x = _inputs()
    with pytest.raises(ValueError, match="sigma has shape"):
        sde_step(v, x, torch.tensor([0.5, 0.4]), 0.3)
    with pytest.raises(ValueError, match="kind"):
        sde_step(v, x, 0.5, 0.3, kind="ddim")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sigma_next < sigma"):
        sde_step(v, x, 0.3, 0.5)
    with pytest.raises(ValueError, match="prev_sample"):
        sde_step(v, x, 0.5, 0.3, prev_sample=torch.zeros(2, 2))
