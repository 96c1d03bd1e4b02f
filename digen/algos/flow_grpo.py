"""Flow-GRPO: clipped GRPO on the log-probs of stochastic (SDE) denoising steps.

Peer: yifan123/flow_grpo @9745241 (read through its mirror Xianchao-Wu/flow_grpo; the later
commits there are a reader's notes) scripts/train_sd3.py ``main`` (the training loop) and
``compute_log_prob``; flow_grpo/diffusers_patch/sd3_sde_with_logprob.py
``sde_step_with_logprob``.

Rollout: every one of the ``T`` steps is an SDE step (:func:`digen.algos.sde.sde_step`,
``rollout.sde.kind``) that keeps its log-prob, a per-element MEAN of the Gaussian log
density. Trajectory: ``latents [B, T+1, *latent]``, ``log_probs [B, T]``, ``sigmas [T+1]``.

Training, per row (sample ``b``, trained step ``j``; ``train.timesteps`` picks ``j``)::

    v      = v_theta(x_j, sigma_j)                       (CFG as the rollout: rollout.guidance_scale)
    logp   = log N(x_{j+1}; mu_theta(x_j), s_j^2)        (the stored x_{j+1} re-scored)
    r      = exp(logp - logp_old)
    loss   = max(-A r, -A clamp(r, 1 - eps, 1 + eps))    eps = train.clip_range, A = clamp(adv, +-adv_clip)
           + kl_beta * KL                                 (train.kl_beta > 0)

with ``KL = mean((mu_theta - mu_ref)^2) / (2 std_dev_t^2)`` (Flow-GRPO's, ``train.kl_target:
mean``) or ``KL = mean((v_theta - v_ref)^2)`` (``velocity``: the KL its maintainer recommends
for training without CFG and sampling with CFG at test time, yifan123/flow_grpo issue #198;
the formula is DiffusionNFT's ``kl_div_loss``, NVlabs/DiffusionNFT scripts/train_nft_sd3.py
``main`` @24af555), ``ref`` the base weights (LoRA off). The optimizer step averages the loss
over the rows of its mini-batch (``train.mini_batches``), as accelerate's
``gradient_accumulation_steps = micro_batches * num_train_timesteps`` does.

This module is also the GRPO family's base (:class:`GrpoFamily`): Flow-GRPO-Fast, CPS,
DanceGRPO, MixGRPO and GRPO-Guard change its rollout plan, its trained steps or its loss.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from digen.algos.loss import LossTerms, ppo_clip_loss, velocity_kl
from digen.algos.registry import Algorithm, RolloutPlan
from digen.algos.rows import TrainRows, transition_rows
from digen.algos.sde import SdeStep, kl_to_reference, sde_step
from digen.algos.timesteps import sde_step_mask, select_timesteps
from digen.seeding import iteration_generator, sample_generator

if TYPE_CHECKING:
    from digen.config.schema import Config
    from digen.models.base import FlowPolicy, PromptEmbeds

GRPO_TRAJECTORY = {
    "latents": "[B, T+1, *latent] x_0 (noise) .. x_T (final latent)",
    "log_probs": "[B, T] behaviour log-prob of each step (per-element mean; NaN on ODE steps)",
    "sigmas": "[T+1] the rollout schedule",
}


def window_steps(cfg: Config, iteration: int) -> list[int] | None:
    """The SDE window of an iteration (``train.timesteps.strategy: window``), shared by all
    its samples; None for the other strategies."""
    ts = cfg.train.timesteps
    if ts.strategy != "window":
        return None
    gen = iteration_generator(cfg.seed, iteration, "window")
    return select_timesteps(
        cfg.rollout.num_steps,
        strategy="window",
        fraction=ts.fraction,
        window=ts.window,
        window_range=ts.window_range,
        generator=gen,
    )


def timestep_selection(cfg: Config, iteration: int, sample_id: int) -> list[int]:
    """``train.timesteps``' steps of one sample (:func:`digen.algos.timesteps.select_timesteps`):
    the iteration's window, or the sample's own prefix / random subset."""
    ts = cfg.train.timesteps
    if ts.strategy == "window":
        steps = window_steps(cfg, iteration)
        assert steps is not None
        return steps
    gen = sample_generator(cfg.seed, iteration, sample_id, "timesteps")
    return select_timesteps(
        cfg.rollout.num_steps, strategy=ts.strategy, fraction=ts.fraction, window=ts.window, generator=gen
    )


def stored_transitions(spec: Any, traj: dict[str, torch.Tensor]) -> TrainRows:
    """The rows of ``spec`` (its samples, advantages and steps) from a GRPO trajectory dict:
    ``latents [G, S+1, *latent]``, ``log_probs [G, S]``, ``sigmas [T+1]``, optional
    ``first_step`` (0-d, default 0) and ``means [G, S, *latent]``."""
    keep = torch.tensor(spec.samples, dtype=torch.long)
    means = traj.get("means")
    return transition_rows(
        traj["latents"].index_select(0, keep),
        traj["log_probs"].index_select(0, keep),
        traj["sigmas"],
        torch.tensor(spec.advantages, dtype=torch.float32),
        spec.steps,
        first_step=int(traj["first_step"]) if "first_step" in traj else 0,
        means=None if means is None else means.index_select(0, keep),
    )


def rescore(
    policy: FlowPolicy, chunk: TrainRows, embeds: PromptEmbeds, cfg: Config, sigma_max: float
) -> tuple[torch.Tensor, SdeStep, dict[str, Any]]:
    """The current policy's velocity ``[R, *latent]`` at the rows' ``x_j`` and its SDE step
    re-scoring the stored ``x_{j+1}`` (``SdeStep.log_prob [R]``, ``mean``, ``std``); also the
    step's keyword arguments (to re-run it on a reference velocity). Differentiable."""
    r, t = cfg.rollout, cfg.train
    device = policy.device
    x = chunk.x.to(device, non_blocking=True)
    sigma, x_next = chunk.sigma.to(device, non_blocking=True), chunk.x_next.to(device, non_blocking=True)
    sde: dict[str, Any] = {
        "kind": r.sde.kind,
        "noise_level": r.sde.noise_level,
        "prev_sample": x_next,
        "sigma_max": sigma_max,
    }
    v = policy.velocity(x, sigma, embeds.index(chunk.sample), r.guidance_scale, cfg_grad=t.cfg_grad)
    # the step's sigma checks read the chunk's own (host) sigmas: no wait for the device
    return v, sde_step(v, x, chunk.sigma, chunk.sigma_next, **sde), sde


def reference_kl(
    policy: FlowPolicy,
    chunk: TrainRows,
    embeds: PromptEmbeds,
    cfg: Config,
    v: torch.Tensor,
    step: SdeStep,
    sde: dict,
) -> torch.Tensor:
    """KL ``[R]`` of the rows' steps to the reference policy (the base weights), on the
    transition mean (``train.kl_target: mean``, Flow-GRPO) or on the velocity (``velocity``)."""
    device = policy.device
    x, sigma = chunk.x.to(device, non_blocking=True), chunk.sigma.to(device, non_blocking=True)
    with torch.no_grad(), policy.reference_mode():
        v_ref = policy.velocity(x, sigma, embeds.index(chunk.sample), cfg.rollout.guidance_scale)
    if (cfg.train.kl_target or "mean") == "velocity":
        return velocity_kl(v, v_ref)
    ref = sde_step(v_ref, x, chunk.sigma, chunk.sigma_next, **sde)
    return kl_to_reference(step.mean, ref.mean, step.std)


class GrpoFamily(Algorithm):
    """Clipped GRPO on stored SDE transitions: the shared rollout, rows and loss."""

    trajectory = GRPO_TRAJECTORY

    def rollout_plan(self, cfg: Config, iteration: int) -> RolloutPlan:
        """SDE on every step (``window``: SDE in the iteration's window, Euler elsewhere);
        every transition kept."""
        n = cfg.rollout.num_steps
        window = window_steps(cfg, iteration)
        mask = sde_step_mask(n, window or [], cfg.train.timesteps.strategy)
        return RolloutPlan(kinds=tuple("sde" if m else "ode" for m in mask), keep=(0, n))

    def trained_steps(self, cfg: Config, iteration: int, sample_id: int) -> list[int]:
        return timestep_selection(cfg, iteration, sample_id)

    def rows(self, spec: Any, traj: dict[str, torch.Tensor], cfg: Config) -> TrainRows:
        return stored_transitions(spec, traj)

    def loss(
        self, policy: FlowPolicy, rows: TrainRows, embeds: PromptEmbeds, cfg: Config, sigma_max: float
    ) -> tuple[torch.Tensor, LossTerms, torch.Tensor]:
        """Per row: :meth:`policy_loss` of the re-scored transition, plus ``kl_beta * KL``."""
        t = cfg.train
        # --- re-score the stored transition x -> x_next under the current policy
        v, step, sde = rescore(policy, rows, embeds, cfg, sigma_max)
        terms = self.policy_loss(step, rows, cfg, policy.device)
        loss = terms.loss
        # --- optional KL to the base weights (LoRA disabled)
        kl = torch.zeros_like(loss)
        if t.kl_beta > 0:
            kl = reference_kl(policy, rows, embeds, cfg, v, step, sde)
            loss = loss + t.kl_beta * kl
        return loss, terms, kl

    def policy_loss(self, step: SdeStep, rows: TrainRows, cfg: Config, device: torch.device) -> LossTerms:
        """Per row: the clipped surrogate of the re-scored ``step``'s ratio (the one part of the
        loss each member of the family defines its own way)."""
        return ppo_clip_loss(
            step.log_prob,
            rows.old_log_prob.to(device, non_blocking=True),
            rows.advantage.to(device, non_blocking=True),
            cfg.train.clip_range,
        )

    def _kind_check(self, cfg: Config, kind: str) -> list[str]:
        if cfg.train.algorithm == self.name and cfg.rollout.sde.kind != kind:
            return [
                f"train.algorithm ({self.name}) samples with rollout.sde.kind {kind}, got "
                f"{cfg.rollout.sde.kind}; set rollout.sde.kind={kind} or choose another algorithm"
            ]
        return []


class FlowGrpo(GrpoFamily):
    name = "flow-grpo"
    title = "Flow-GRPO"
    order = 0
    peer = (
        "yifan123/flow_grpo @9745241: scripts/train_sd3.py main + compute_log_prob, "
        "flow_grpo/diffusers_patch/sd3_sde_with_logprob.py sde_step_with_logprob"
    )
    summary = "clipped GRPO on the log-probs of SDE steps (Flow-GRPO's 'sde' step), optional KL to the base"
    rollout_needs = "SDE on all T steps, log-probs of all steps"

    def check(self, cfg: Config) -> list[str]:
        problems = self._kind_check(cfg, "sde")
        if cfg.train.algorithm == self.name and cfg.train.timesteps.strategy == "window":
            problems.append(
                "train.algorithm (flow-grpo) trains SDE steps everywhere; train.timesteps.strategy window "
                "is flow-grpo-fast: set train.algorithm=flow-grpo-fast"
            )
        return problems


ALGORITHM = FlowGrpo()
