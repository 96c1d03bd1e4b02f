"""The clipped PPO policy loss of GRPO, per sample (the caller chooses the reduction).

For one trained timestep of each trajectory, with ``r = exp(logp_new - logp_old)``:
``loss = max(-A * r, -A * clamp(r, 1 - eps, 1 + eps))``, eps = ``clip_range`` (~1e-4 for
Flow-GRPO, whose log-probs are per-element means). Flow-GRPO averages this over the batch
(``mean_b``); returning it unreduced lets time-step-parallel workers sum exactly the terms the
sequential loop would have averaged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from digen.algos.precision import at_least_float32
from digen.errors import AlgorithmError


@dataclass(frozen=True)
class LossTerms:
    """loss: [B] policy loss per sample (carries the gradient of ``log_prob``).
    ratio: [B] ``exp(logp - logp_old)``, detached.
    clipped: [B] bool, ``|ratio - 1| > clip_range`` (Flow-GRPO's clipfrac numerator).
    approx_kl: [B] ``0.5 * (logp - logp_old)**2``, detached.
    """

    loss: Tensor
    ratio: Tensor
    clipped: Tensor
    approx_kl: Tensor


def ppo_clip_loss(log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, clip_range: float) -> LossTerms:
    """Clipped surrogate loss per sample.

    log_prob: [B] log-prob of the stored x_{t+1} under the current policy (with gradient).
    old_log_prob: [B] the behaviour policy's log-prob, stored at generation (no gradient).
    advantages: [B] (no gradient). clip_range: eps > 0.
    All computed in float32 (float64 when ``log_prob`` is: :mod:`digen.algos.precision`). The gradient of ``loss`` w.r.t. ``log_prob`` is ``-A * r``
    inside the trust region and 0 where the clamp is the larger term.
    """
    if log_prob.ndim != 1 or old_log_prob.shape != log_prob.shape or advantages.shape != log_prob.shape:
        raise AlgorithmError(
            f"log_prob {tuple(log_prob.shape)}, old_log_prob {tuple(old_log_prob.shape)} and advantages "
            f"{tuple(advantages.shape)} must all be the same [B] vector"
        )
    if not math.isfinite(clip_range) or clip_range <= 0:
        raise AlgorithmError(f"clip_range={clip_range} must be a finite number > 0 (Flow-GRPO uses 1e-4)")
    logp = at_least_float32(log_prob)
    old = old_log_prob.detach().to(device=logp.device, dtype=logp.dtype)
    adv = advantages.detach().to(device=logp.device, dtype=logp.dtype)

    ratio = torch.exp(logp - old)
    unclipped = -adv * ratio
    clipped_term = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    loss = torch.maximum(unclipped, clipped_term)

    ratio_value = ratio.detach()
    return LossTerms(
        loss=loss,
        ratio=ratio_value,
        clipped=(ratio_value - 1.0).abs() > clip_range,
        approx_kl=0.5 * (logp.detach() - old) ** 2,
    )


def velocity_kl(velocity: Tensor, ref_velocity: Tensor) -> Tensor:
    """KL surrogate on the velocity: ``mean((v - v_ref)**2)`` over the non-batch elements, ``[B]``.

    velocity: [B, ...] the policy's (with gradient); ref_velocity: [B, ...] the reference
    policy's (base weights). DiffusionNFT's ``kl_div_loss`` (NVlabs/DiffusionNFT
    scripts/train_nft_sd3.py ``main`` @24af555), and the KL Flow-GRPO's maintainer recommends
    when training without CFG and sampling with CFG at test time (yifan123/flow_grpo issue
    #198: "the KL should be applied directly on the velocity rather than on the latent").
    Computed in float32 (float64 when ``velocity`` is).
    """
    v = at_least_float32(velocity)
    ref = ref_velocity.detach().to(device=v.device, dtype=v.dtype)
    if v.shape != ref.shape or v.ndim == 0:
        raise AlgorithmError(
            f"velocity {tuple(v.shape)} and ref_velocity {tuple(ref.shape)} must have the same [B, ...] shape"
        )
    return ((v - ref) ** 2).reshape(v.shape[0], -1).mean(dim=1)
