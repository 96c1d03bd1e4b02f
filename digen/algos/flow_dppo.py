"""Flow-DPPO: Flow-GRPO with the PPO clip replaced by an exact divergence trust-region mask.

Peer: verl-project/verl-omni @a1139ba verl_omni/trainer/diffusion/diffusion_algos.py
``FlowDPPOLoss.compute_loss`` (with ``add_kl_coefficient`` true, its default) and
docs/algo/flowdppo.md (Flow-DPPO, arXiv 2606.11025, UniRL; VeRL-Omni's restatement is the code
read here). Recipe: examples/flowdppo_trainer/qwen_image/run_qwen_image_ocr_lora.sh
(``kl_mask_threshold=1e-5``, ``sde_type=sde``).

Rollout: Flow-GRPO's SDE on every step, keeping each step's transition mean (as GRPO-Guard:
``means [B, T, *latent]``). The old and the current policy's steps share their variance, so
their per-step KL is exact. Per row (``s = std_dev_t sqrt(dt)`` the transition std)::

    r    = exp(logp - logp_old)
    D    = mean((mu_theta - mu_old)^2) / (2 s^2)
    loss = 0          if D >= eps_D and ((A > 0 and r > 1) or (A < 0 and r < 1))
           -A r       otherwise                              (+ kl_beta * Flow-GRPO's KL)

``eps_D = train.flow_dppo.kl_threshold``. An update is dropped only when it is outside the
trust region AND still moving away from the rollout policy; corrective updates stay. The
mask carries no gradient. VeRL-Omni does not clamp the advantages here; digen's are clamped
to ``train.adv_clip`` when they are computed (5: an advantage beyond it needs a group std
below a fifth of a deviation).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from digen.algos.grpo_guard import GrpoGuard, refuse_noiseless_rows
from digen.algos.loss import LossTerms
from digen.algos.precision import at_least_float32

if TYPE_CHECKING:
    from digen.algos.rows import TrainRows
    from digen.algos.sde import SdeStep
    from digen.config.schema import Config


def divergence_masked_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    mean: torch.Tensor,
    old_mean: torch.Tensor,
    transition_std: torch.Tensor,
    advantages: torch.Tensor,
    kl_threshold: float,
) -> LossTerms:
    """Flow-DPPO's masked surrogate per row.

    log_prob: [R] current (with gradient); old_log_prob: [R]; mean: [R, *latent] current
    transition mean; old_mean: [R, *latent] stored; transition_std: [R] (> 0); advantages: [R].
    Returns ``loss [R]``, the ratio, ``clipped`` = the masked rows, ``0.5 (logp - logp_old)^2``.
    """
    refuse_noiseless_rows("Flow-DPPO", transition_std)
    logp = at_least_float32(log_prob)
    dtype, device = logp.dtype, logp.device
    old = old_log_prob.detach().to(device=device, dtype=dtype)
    adv = advantages.detach().to(device=device, dtype=dtype)
    s = transition_std.detach().to(device=device, dtype=dtype)
    mu = at_least_float32(mean)
    diff = (mu - old_mean.detach().to(device=device, dtype=mu.dtype)).reshape(mu.shape[0], -1)
    divergence = ((diff**2).mean(dim=1) / (2 * s**2)).detach()
    ratio = torch.exp(logp - old)
    r = ratio.detach()
    outside = divergence >= kl_threshold
    masked = outside & (((r > 1.0) & (adv > 0)) | ((r < 1.0) & (adv < 0)))
    loss = torch.where(masked, torch.zeros_like(ratio), -adv * ratio)
    return LossTerms(loss=loss, ratio=r, clipped=masked, approx_kl=0.5 * (logp.detach() - old) ** 2)


class FlowDppo(GrpoGuard):
    """GRPO-Guard's rollout, checks and trajectory (the transition means), its own loss."""

    name = "flow-dppo"
    title = "Flow-DPPO"
    order = 6
    peer = (
        "verl-project/verl-omni @a1139ba: verl_omni/trainer/diffusion/diffusion_algos.py FlowDPPOLoss "
        "(Flow-DPPO, arXiv 2606.11025)"
    )
    summary = "Flow-GRPO with the ratio clip replaced by an exact per-step KL trust-region mask"

    def policy_loss(self, step: SdeStep, rows: TrainRows, cfg: Config, device: torch.device) -> LossTerms:
        """Per row: ``-A r`` unless masked (GRPO-Guard's :meth:`loss` adds ``kl_beta * KL``)."""
        assert rows.old_mean is not None  # checked by loss, before the forward
        return divergence_masked_loss(
            step.log_prob,
            rows.old_log_prob.to(device, non_blocking=True),
            step.mean,
            rows.old_mean.to(device, non_blocking=True),
            step.transition_std,
            rows.advantage.to(device, non_blocking=True),
            cfg.train.flow_dppo.kl_threshold,
        )


ALGORITHM = FlowDppo()
