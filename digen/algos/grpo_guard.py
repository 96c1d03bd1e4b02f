"""GRPO-Guard: Flow-GRPO with a normalised importance ratio and per-step gradient reweighting.

Peer: yifan123/flow_grpo @9745241 scripts/train_sd3_GRPO_Guard.py ``main`` (the
``config.rationorm`` branch of the training loop) and ``compute_log_prob`` with
``return_sqrt_dt``; flow_grpo/diffusers_patch/sd3_sde_with_logprob.py; recipes in
config/grpo_guard.py (``general_ocr_sd3_rationorm``: clip 2e-6, lr 1e-4, two optimizer
steps per rollout batch).

Why: with Flow-GRPO's per-element-mean log-prob, ``logp - logp_old`` carries a term
``-mean((mu - mu_old)^2) / (2 s^2)`` (``s = std_dev_t sqrt(dt)`` the transition std) that is
negative whatever the sample, and whose size grows as ``s`` shrinks: ratios drift below 1
and later steps get small, noisy gradients. GRPO-Guard adds that term back and rescales, per
row (sample ``b``, step ``j``, ``dt = sigma_j - sigma_{j+1}``)::

    bias  = mean((mu_theta - mu_old)^2) / (2 s^2)                      s = std_dev_t sqrt(dt)
    r     = exp((logp - logp_old + bias) * s)
    loss  = max(-A r, -A clamp(r, 1 - eps, 1 + eps)) / dt    (+ kl_beta * Flow-GRPO's KL)

``mu_old`` is the behaviour policy's transition mean, stored by the rollout: the trajectory
holds ``means [B, T, *latent]`` beside Flow-GRPO's latents and log-probs (twice the latent
data). ``bias`` carries gradient through ``mu_theta``.

VeRL-Omni's restatement (verl-project/verl-omni @a1139ba verl_omni/trainer/diffusion/
diffusion_algos.py ``GRPOGuardLoss``) reduces the bias per sample, as digen does.

Deviation from the peer, on purpose: the peer computes ``bias`` as
``(...).pow(2).mean(dim=tuple(range(1, log_prob.ndim)))`` on a ``[B]`` log-prob, an empty
tuple, over which torch reduces every dimension: the peer's bias is the MEAN over its
micro-batch of samples (and ``s``, ``dt`` its ``.mean()`` over the micro-batch, all at one
timestep, so those agree). digen uses each row's own bias (the per-sample formula the
docstring above derives): a task's gradient must not depend on how its rows are packed into
forwards. With one sample per micro-batch the two are equal, which is how the oracle test
(tests/trainer/test_algorithm_oracles.py) restates the peer.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from digen.algos.flow_grpo import GRPO_TRAJECTORY, GrpoFamily
from digen.algos.loss import LossTerms
from digen.algos.precision import at_least_float32
from digen.algos.registry import RolloutPlan
from digen.errors import AlgorithmError

if TYPE_CHECKING:
    from digen.algos.rows import TrainRows
    from digen.algos.sde import SdeStep
    from digen.config.schema import Config
    from digen.models.base import FlowPolicy, PromptEmbeds


def refuse_noiseless_rows(name: str, transition_std: torch.Tensor, dt: torch.Tensor | None = None) -> None:
    """Refuse rows without noise (a transition std or a ``dt`` that is not > 0): GRPO-Guard's
    ratio and Flow-DPPO's divergence divide by them.

    Read where the values are on the host (``dt`` from a training chunk's sigmas, CPU in every
    mode; a CPU run's std), never read back from a device: one wait per loss would stall the
    launch of the backward behind the forward. A device-side std is positive by the checks made
    before it exists: the algorithm's config check refuses ``rollout.sde.noise_level`` 0 (the
    Euler step), and :func:`digen.algos.sde.sde_step` refuses sigmas outside (0, 1] and
    ``sigma_next >= sigma``, so ``std_dev_t sqrt(dt)`` is > 0 on every trained row.
    """
    for what, values in (("transition std", transition_std), ("dt", dt)):
        if values is not None and values.device.type == "cpu" and bool((values <= 0).any()):
            raise AlgorithmError(f"{name} needs stochastic steps ({what} > 0 on every row)")


def guard_ratio_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    mean: torch.Tensor,
    old_mean: torch.Tensor,
    transition_std: torch.Tensor,
    dt: torch.Tensor,
    advantages: torch.Tensor,
    clip_range: float,
) -> LossTerms:
    """GRPO-Guard's clipped surrogate per row.

    log_prob: [R] current (with gradient); old_log_prob: [R] stored; mean: [R, *latent] the
    current transition mean (with gradient); old_mean: [R, *latent] stored; transition_std:
    [R] ``std_dev_t * sqrt(dt)``; dt: [R] ``sigma - sigma_next`` (> 0); advantages: [R].
    Returns ``loss [R]`` (already divided by ``dt``), the normalised ratio, the clip flags and
    ``0.5 (logp - logp_old)^2``.
    """
    refuse_noiseless_rows("GRPO-Guard", transition_std, dt)
    logp = at_least_float32(log_prob)
    dtype, device = logp.dtype, logp.device
    s = transition_std.detach().to(device=device, dtype=dtype)
    old = old_log_prob.detach().to(device=device, dtype=dtype)
    adv = advantages.detach().to(device=device, dtype=dtype)
    step_dt = dt.detach().to(device=device, dtype=dtype, non_blocking=True)
    mu = at_least_float32(mean)
    diff = (mu - old_mean.detach().to(device=device, dtype=mu.dtype)).reshape(mu.shape[0], -1)
    bias = (diff**2).mean(dim=1) / (2 * s**2)
    ratio = torch.exp((logp - old + bias) * s)
    unclipped = -adv * ratio
    clipped_term = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    loss = torch.maximum(unclipped, clipped_term) / step_dt
    r = ratio.detach()
    return LossTerms(
        loss=loss, ratio=r, clipped=(r - 1.0).abs() > clip_range, approx_kl=0.5 * (logp.detach() - old) ** 2
    )


class GrpoGuard(GrpoFamily):
    name = "grpo-guard"
    title = "GRPO-Guard"
    order = 5
    peer = (
        "yifan123/flow_grpo @9745241: scripts/train_sd3_GRPO_Guard.py main (config.rationorm) + "
        "compute_log_prob(return_sqrt_dt), config/grpo_guard.py"
    )
    summary = "Flow-GRPO with the ratio re-centred by the mean shift and scaled by s, each step's loss divided by dt"
    rollout_needs = "SDE (kind sde) on all T steps, log-probs and transition means of all steps"
    trajectory = {
        **GRPO_TRAJECTORY,
        "means": "[B, T, *latent] behaviour transition mean of each step (NaN on ODE steps)",
    }

    def check(self, cfg: Config) -> list[str]:
        problems = []
        if cfg.rollout.sde.kind != "sde":
            problems.append(
                f"train.algorithm ({self.name}) reads Flow-GRPO's Gaussian SDE step (its transition mean "
                f"and std): it needs rollout.sde.kind sde, got {cfg.rollout.sde.kind}"
            )
        if cfg.rollout.sde.noise_level == 0:
            problems.append(
                f"train.algorithm ({self.name}) divides by the transition std: rollout.sde.noise_level "
                "must be > 0 (0 is the deterministic Euler step)"
            )
        return problems

    def rollout_plan(self, cfg: Config, iteration: int) -> RolloutPlan:
        """Flow-GRPO's plan (SDE on every step; ``window``: SDE in the iteration's window, Euler
        elsewhere, as VeRL-Omni's GRPO-Guard and Flow-DPPO examples sample with
        ``sde_window_size 2``), keeping each step's transition mean (NaN on Euler steps)."""
        return replace(super().rollout_plan(cfg, iteration), means=True)

    def loss(
        self, policy: FlowPolicy, rows: TrainRows, embeds: PromptEmbeds, cfg: Config, sigma_max: float
    ) -> tuple[torch.Tensor, LossTerms, torch.Tensor]:
        """Per row: the normalised ratio's clipped surrogate divided by ``dt``, plus
        ``kl_beta * KL`` (Flow-GRPO's, not divided)."""
        if rows.old_mean is None:
            raise AlgorithmError(
                f"{self.name} trains from the behaviour transition means; these trajectories have no "
                "'means' (generated by another algorithm?)"
            )
        return super().loss(policy, rows, embeds, cfg, sigma_max)

    def policy_loss(self, step: SdeStep, rows: TrainRows, cfg: Config, device: torch.device) -> LossTerms:
        assert rows.old_mean is not None  # checked by loss, before the forward
        return guard_ratio_loss(
            step.log_prob,
            rows.old_log_prob.to(device, non_blocking=True),
            step.mean,
            rows.old_mean.to(device, non_blocking=True),
            step.transition_std,
            rows.sigma - rows.sigma_next,
            rows.advantage.to(device, non_blocking=True),
            cfg.train.clip_range,
        )


ALGORITHM = GrpoGuard()
