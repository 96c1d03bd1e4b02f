"""digen.algos.loss: values and gradient directions of the clipped surrogate."""

from __future__ import annotations

import math

import pytest
import torch

from digen.algos import ppo_clip_loss


def test_ratio_one_gives_minus_advantage() -> None:
    old = torch.tensor([-1.2, 0.3, 2.0])
    adv = torch.tensor([1.5, -0.5, 0.0])
    terms = ppo_clip_loss(old.clone(), old, adv, 1e-4)
    assert torch.equal(terms.loss, -adv)
    assert torch.equal(terms.ratio, torch.ones(3))
    assert not terms.clipped.any()
    assert torch.equal(terms.approx_kl, torch.zeros(3))


def test_gradient_pushes_log_prob_along_the_advantage() -> None:
    old = torch.tensor([0.1, -0.4])
    logp = old.clone().requires_grad_(True)
    ppo_clip_loss(logp, old, torch.tensor([2.0, -3.0]), 0.1).loss.sum().backward()
    assert logp.grad is not None
    assert logp.grad[0] < 0 and logp.grad[1] > 0  # descent raises logp where A > 0, lowers it where A < 0
    torch.testing.assert_close(logp.grad, torch.tensor([-2.0, 3.0]))  # -A * r at r == 1


def test_clipping_kills_the_gradient_only_in_the_direction_of_the_advantage() -> None:
    eps = 0.1
    old = torch.zeros(4)
    ratios = torch.tensor([1.5, 0.5, 0.5, 1.5])
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    logp = torch.log(ratios).requires_grad_(True)
    terms = ppo_clip_loss(logp, old, adv, eps)
    terms.loss.sum().backward()
    assert logp.grad is not None
    # A>0, r>1+eps: clipped, no gradient. A>0, r<1-eps: unclipped (pessimistic), grad -A*r.
    # A<0, r<1-eps: clipped, no gradient. A<0, r>1+eps: unclipped, grad -A*r.
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, -0.5, 0.0, 1.5]))
    torch.testing.assert_close(terms.loss.detach(), torch.tensor([-1.1, -0.5, 0.9, 1.5]))
    assert terms.clipped.tolist() == [True, True, True, True]


def test_approx_kl_and_clipped_flags() -> None:
    old = torch.tensor([0.0, 0.0])
    logp = torch.tensor([0.5e-4, 3e-4])
    terms = ppo_clip_loss(logp, old, torch.ones(2), 1e-4)
    assert terms.clipped.tolist() == [False, True]
    torch.testing.assert_close(terms.approx_kl, 0.5 * logp**2)
    torch.testing.assert_close(terms.ratio, torch.exp(logp))


def test_no_gradient_reaches_old_log_prob_or_advantages() -> None:
    old = torch.tensor([0.2]).requires_grad_(True)
    adv = torch.tensor([1.0]).requires_grad_(True)
    logp = torch.tensor([0.25]).requires_grad_(True)
    ppo_clip_loss(logp, old, adv, 0.2).loss.sum().backward()
    assert old.grad is None and adv.grad is None
    assert logp.grad is not None and logp.grad.item() == pytest.approx(-math.exp(0.05))


def test_bad_inputs_raise() -> None:
    with pytest.raises(ValueError, match="same"):
        ppo_clip_loss(torch.zeros(3), torch.zeros(2), torch.zeros(3), 0.1)
    with pytest.raises(ValueError, match="clip_range"):
        ppo_clip_loss(torch.zeros(3), torch.zeros(3), torch.zeros(3), 0.0)


def test_float64_log_probs_keep_float64_and_float32_ones_stay_float32() -> None:
    """``model.dtype: float64`` (numerical checks) keeps the loss in float64; anything else
    computes in float32, as before."""
    logp = torch.tensor([-1.0, -2.0, -3.0])
    adv = torch.tensor([1.0, -1.0, 0.5])
    for dtype, want in (
        (torch.float64, torch.float64),
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
    ):
        terms = ppo_clip_loss(logp.to(dtype), logp + 1e-3, adv, 1e-4)
        assert terms.loss.dtype == terms.ratio.dtype == want
