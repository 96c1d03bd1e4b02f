"""DiffusionNFT: online RL by fitting the clean samples forward, with implicit positive and
negative velocities; no log-probs, no per-step trajectory.

Peer: NVlabs/DiffusionNFT @24af555 scripts/train_nft_sd3.py ``main`` (sampling with the
``old`` adapter, the training loop, the ``old`` adapter's update after each epoch) and
``return_decay``; flow_grpo/diffusers_patch/solver.py ``run_sampling`` (``solver="dpm2"``,
``deterministic=True``); recipes in config/nft.py (CFG-free: ``sample.guidance_scale = 1``).

Rollout: any deterministic solver (``train.nft.solver``: DPM-Solver++(2M), the recipes'
``dpm2``, or Euler), sampling with the ``old`` weights (below). The trajectory holds only the
clean final latent ``latents [B, 1, *latent]`` (``first_step`` = T, ``log_probs [B, 0]``)
and ``sigmas [T+1]``: a generation task moves one latent per sample.
The rollout plan, the rows and the forward noising are the clean-sample family's
(:mod:`digen.algos.clean_sample`), shared with DGPO.

Training, per row (sample ``b`` with clean latent ``x0``, sigma ``t`` = ``sigmas[j]`` for each
of ``int(T * fraction)`` steps ``j`` drawn without replacement from ``0 .. T-1``, or with
``train.nft.step_range = [a, b]`` one in each of as many strata of ``a .. b - 1`` (Flow-Factory's
``TimeSampler.discrete``), ``noise ~ N(0, I)`` from the sample's seeded stream)::

    x_t   = (1 - t) x0 + t noise
    v     = v_theta(x_t, t);  v_old = v_old(x_t, t) (no grad);  v_ref = v_base(x_t, t) (no grad, kl)
    r     = clamp(clamp(A, -C, C) / C / 2 + 0.5, 0, 1)                C = train.adv_clip
    v+    = beta v + (1 - beta) v_old,    v- = (1 + beta) v_old - beta v      beta = train.nft.beta
    L+    = mean((x_t - t v+ - x0)^2 / w+),  w+ = max(mean|x_t - t v+ - x0|, 1e-5) (no grad); L- alike
    loss  = C (r L+ + (1 - r) L-) / beta  +  kl_beta * mean((v - v_ref)^2)

The optimizer step averages over its mini-batch's rows (the peer divides by
``gradient_accumulation_steps * num_train_timesteps``).

The ``old`` weights: a copy of the trained tensors, version 0's at the start; after the last
optimizer step of each iteration (the peer's epoch) ``old <- d old + (1 - d) theta`` with
``d = return_decay(steps so far, train.nft.decay_type)``: type 0 ``d = 0``; type 1
``min(0.001 steps, 0.5)``; type 2 ``0`` for 75 steps, then ``min(0.0075 (steps - 75), 0.999)``.
They live in the optimizer store's state and travel with each version as
``algo/old/<name>`` (:mod:`digen.algos.state`); a checkpoint keeps them, so ``--resume``
continues them (the peer restarts them from the trained adapter).

Staleness: the loss needs no behaviour log-prob, so a trajectory from an older version is
still a valid sample to fit (it is "off-policy" only in that the old weights that drew it
are older); digen keeps the same bound as for every algorithm (``schedule.max_staleness``,
at most one iteration). It runs in every mode; its state rides with each version to the
rollout workers, and a trainer group keeps it replicated (not with ``train.fsdp``, whose
sharded store holds the trained tensors only).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from digen.algos.clean_sample import CleanSampleFamily, noised, strata_steps
from digen.algos.loss import LossTerms, velocity_kl
from digen.algos.precision import at_least_float32
from digen.algos.registry import StepKind
from digen.algos.rows import NoisedRows
from digen.algos.state import moved_toward, require_role, swapped_weights, with_role
from digen.seeding import sample_generator

if TYPE_CHECKING:
    from digen.config.schema import Config, TrainConfig
    from digen.models.base import FlowPolicy, PromptEmbeds

ROLE = "old"


def nft_decay(steps: int, decay_type: int) -> float:
    """The ``old`` weights' EMA decay after ``steps`` optimizer steps (the peer's
    ``return_decay``)."""
    flat, rate, cap = {0: (0, 0.0, 0.0), 1: (0, 0.001, 0.5), 2: (75, 0.0075, 0.999)}[decay_type]
    if steps < flat:
        return 0.0
    return min((steps - flat) * rate, cap)


def nft_policy_loss(
    v: torch.Tensor,
    v_old: torch.Tensor,
    xt: torch.Tensor,
    x0: torch.Tensor,
    sigma: torch.Tensor,
    advantages: torch.Tensor,
    *,
    beta: float,
    adv_clip: float,
) -> torch.Tensor:
    """The reward-weighted implicit positive/negative loss per row, ``[R]``.

    v: [R, *latent] the policy's velocity (with gradient); v_old: [R, *latent] the old
    weights'; xt, x0: [R, *latent] the noised and the clean latent; sigma: [R] the noise level
    ``t``; advantages: [R]. Computed in float32 (float64 when ``v`` is).
    """
    v = at_least_float32(v)
    dtype, device = v.dtype, v.device
    v_old = v_old.detach().to(device=device, dtype=dtype)
    xt, x0 = xt.to(device=device, dtype=dtype), x0.to(device=device, dtype=dtype)
    t = sigma.to(device=device, dtype=dtype).reshape(-1, *([1] * (v.ndim - 1)))
    a = advantages.detach().to(device=device, dtype=dtype).clamp(-adv_clip, adv_clip)
    r = (a / adv_clip / 2.0 + 0.5).clamp(0.0, 1.0)
    positive = beta * v + (1.0 - beta) * v_old
    negative = (1.0 + beta) * v_old - beta * v
    pos = _weighted_x0_error(xt - t * positive, x0)
    neg = _weighted_x0_error(xt - t * negative, x0)
    return adv_clip * (r * pos / beta + (1.0 - r) * neg / beta)


def _weighted_x0_error(x0_hat: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """``mean((x0_hat - x0)^2 / w)`` per row with the adaptive weight ``w = max(mean|x0_hat -
    x0|, 1e-5)`` (no gradient; the peer computes it in float64)."""
    dims = tuple(range(1, x0.ndim))
    with torch.no_grad():
        w = (x0_hat.detach().double() - x0.double()).abs().mean(dim=dims, keepdim=True).clamp(min=1e-5)
    return ((x0_hat - x0) ** 2 / w.to(x0_hat.dtype)).mean(dim=dims)


class DiffusionNft(CleanSampleFamily):
    name = "diffusion-nft"
    title = "DiffusionNFT"
    order = 7
    keeps_state = True
    peer = (
        "NVlabs/DiffusionNFT @24af555: scripts/train_nft_sd3.py main + return_decay, "
        "flow_grpo/diffusers_patch/solver.py run_sampling (dpm2)"
    )
    summary = "fits noised clean samples with reward-weighted implicit positive/negative velocities; EMA 'old' weights"
    rollout_needs = (
        "a deterministic solver (DPM++ 2M or Euler) with the old weights; no log-probs; the final latent only"
    )

    def check(self, cfg: Config) -> list[str]:
        problems = self._lora_problems(cfg)
        span, n = cfg.train.nft.step_range, cfg.rollout.num_steps
        count = max(1, int(n * cfg.train.timesteps.fraction))
        if span is not None and not 0 <= span[0] < span[1] <= n:
            problems.append(
                f"train.nft.step_range ({list(span)}) must be [start, end] with 0 <= start < end <= "
                f"rollout.num_steps ({n}): the strata run over schedule steps start .. end - 1"
            )
        elif span is not None and span[1] - span[0] < count:
            problems.append(
                f"train.nft.step_range ({list(span)}) holds {span[1] - span[0]} steps, fewer than the "
                f"{count} strata of int(rollout.num_steps x train.timesteps.fraction): a stratum would be empty "
                "and train its first step twice; widen the range or lower the fraction"
            )
        if cfg.rollout.guidance_scale > 1.0:
            problems.append(
                f"train.algorithm (diffusion-nft) is CFG-free (its recipes sample and train with guidance 1); "
                f"rollout.guidance_scale ({cfg.rollout.guidance_scale}) must be 1"
            )
        return problems + self._kl_problems(cfg)

    # --- rollout ---------------------------------------------------------------------------
    def solver(self, cfg: Config) -> StepKind:
        return "dpm2" if cfg.train.nft.solver == "dpm2" else "ode"

    def sampling(self, policy: FlowPolicy):
        """Sample with the version's ``old`` weights (the peer's ``set_adapter("old")``)."""
        return swapped_weights(policy, require_role(policy, ROLE, self.name))

    # --- training --------------------------------------------------------------------------
    def trained_steps(self, cfg: Config, iteration: int, sample_id: int) -> list[int]:
        """``int(T * fraction)`` of the T schedule steps, the first of a seeded permutation
        (the peer's ``perms_time``), sorted; with ``train.nft.step_range = [a, b]`` one step in
        each of ``int(T * fraction)`` strata of ``a .. b`` (Flow-Factory's discrete sampler)."""
        n = cfg.rollout.num_steps
        count = max(1, int(n * cfg.train.timesteps.fraction))
        gen = sample_generator(cfg.seed, iteration, sample_id, "timesteps")
        if cfg.train.nft.step_range is not None:
            return strata_steps(*cfg.train.nft.step_range, count, gen)
        return sorted(torch.randperm(n, generator=gen)[:count].tolist())

    def loss(
        self, policy: FlowPolicy, rows: NoisedRows, embeds: PromptEmbeds, cfg: Config, sigma_max: float
    ) -> tuple[torch.Tensor, LossTerms, torch.Tensor]:
        """Per row: the implicit positive/negative loss, plus ``kl_beta * mean((v - v_ref)^2)``."""
        t, g = cfg.train, cfg.rollout.guidance_scale
        device = policy.device
        x0, noise, sigma = (
            rows.x0.to(device, non_blocking=True),
            rows.noise.to(device, non_blocking=True),
            rows.sigma.to(device, non_blocking=True),
        )
        e = embeds.index(rows.sample)
        # --- noise the clean latents forward to each row's sigma
        xt = noised(x0, noise, sigma)
        # --- the old weights' velocity (no gradient), then the policy's
        with torch.no_grad(), swapped_weights(policy, require_role(policy, ROLE, self.name)):
            v_old = policy.velocity(xt, sigma, e, g)
        v = policy.velocity(xt, sigma, e, g, cfg_grad=t.cfg_grad)
        loss = nft_policy_loss(v, v_old, xt, x0, sigma, rows.advantage, beta=t.nft.beta, adv_clip=t.adv_clip)
        # --- optional KL to the base weights, on the velocity
        kl = torch.zeros_like(loss)
        if t.kl_beta > 0:
            with torch.no_grad(), policy.reference_mode():
                v_ref = policy.velocity(xt, sigma, e, g)
            kl = velocity_kl(v, v_ref)
            loss = loss + t.kl_beta * kl
        ones = torch.ones_like(loss.detach())
        terms = LossTerms(
            loss=loss, ratio=ones, clipped=torch.zeros_like(ones, dtype=torch.bool), approx_kl=0 * ones
        )
        return loss, terms, kl

    # --- the old weights -------------------------------------------------------------------
    def initial_state(self, weights: dict[str, torch.Tensor], train: TrainConfig) -> dict[str, torch.Tensor]:
        return with_role(weights, ROLE)

    def next_state(
        self, state: dict[str, torch.Tensor], weights: dict[str, torch.Tensor], train: TrainConfig, steps: int
    ) -> dict[str, torch.Tensor]:
        d = nft_decay(steps, train.nft.decay_type)
        return moved_toward(state, weights, ROLE, d)


ALGORITHM = DiffusionNft()
