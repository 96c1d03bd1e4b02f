"""Online Diffusion-DPO: per prompt group, the best and the worst sample as a chosen/rejected
pair, trained with the Diffusion-DPO loss on the noised clean latents against the base weights.

Peer: verl-project/verl-omni @a1139ba verl_omni/trainer/diffusion/diffusion_algos.py
``DPOLoss`` (``build_online_dpo_pair_indices``, ``compute_loss``), verl_omni/pipelines/utils.py
``sample_noise_and_timesteps`` and ``prepare_noisy_latents``,
verl_omni/pipelines/sd3_dpo/diffusers_training_adapter.py (the SD3 training forward: CFG as
the pipeline's ``guidance_scale``); docs/algo/diffusion_dpo.md; recipe
examples/dpo_trainer/qwen_image/run_qwen_image_online_dpo_lora.sh.

Rollout: the clean-sample family's (:mod:`digen.algos.clean_sample`): a deterministic solver
(``train.online_dpo.solver``; VeRL-Omni's rollout runs the pipeline's Euler flow-matching
scheduler) on every step, CFG as ``rollout.guidance_scale``, the clean final latent kept.

Pairs: in each group the chosen sample is the first of the highest advantage and the rejected
one the last of the lowest (VeRL-Omni sorts a prompt's samples by reward, descending and
stable, and takes the first and the last; within a group the advantage orders samples as the
reward does, ties included, except where ``train.adv_clip`` clamps two rewards to one value).
A group with fewer than two trained samples makes no pair. Only the pair's two samples train.

Per pair: one noise and one training timestep, shared by its two samples: ``u = sigmoid(N(m,
s))``, index ``i = int(1000 u)`` into the model's 1000-step training schedule, ``t =
policy.sigmas(1000)[i]`` (VeRL-Omni: ``compute_density_for_timestep_sampling("logit_normal")``
and ``scheduler.timesteps[indices]`` on ``set_timesteps(num_train_timesteps)``). With
``train.online_dpo.timestep_draw: unshifted`` the same ``u`` gives the continuous ``t = 1 -
(lo + clamp(u, 0.01, 1 - 1e-6) (hi - lo))`` over ``timestep_range`` instead, no shift
(Flow-Factory's ``TimeSampler.logit_normal_shifted`` at ``time_shift`` 1, :func:`unshifted_sigma`;
the step index stays ``i``, for the bookkeeping). Then::

    x_t  = (1 - t) x0 + t noise,   target = noise - x0
    d_w  = mean((v_theta(x_t^w) - target_w)^2) - mean((v_ref(x_t^w) - target_w)^2)   (v_ref: base weights)
    d_l  = the same for the rejected sample
    loss = -log sigmoid(-beta / 2 (d_w - d_l))                              (beta = train.online_dpo.beta)

Each of the pair's two rows carries the pair's loss, so the optimizer step's mean over rows is
VeRL-Omni's mean over pairs. A forward is one pair (:class:`GroupRows`), so a train task holds
whole groups (RAT off, as :mod:`digen.algos.dgpo`).

Staleness: DPO's reference is the fixed base weights and there is no importance ratio; a pair
from the previous version (digen mode) is a preference pair all the same, as VeRL-Omni's
offline DPO trains on pairs from any sampler. digen's bound is the only one
(``schedule.max_staleness``, at most one iteration).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from digen.algos.clean_sample import CleanSampleFamily, GroupRows, flow_target, noised
from digen.algos.loss import LossTerms
from digen.algos.precision import at_least_float32
from digen.algos.registry import StepKind
from digen.errors import AlgorithmError
from digen.seeding import sample_generator

if TYPE_CHECKING:
    from digen.config.schema import Config
    from digen.models.base import FlowPolicy, PromptEmbeds

TRAIN_STEPS = 1000
"""The training schedule a pair's timestep is drawn from (the schedulers' ``num_train_timesteps``)."""


def pair_u(cfg: Config, iteration: int, first: int) -> torch.Tensor:
    """``sigmoid(N(logit_mean, logit_std))`` of the group whose first sample is ``first``, ``[1]``
    float32, from the group's own stream."""
    d = cfg.train.online_dpo
    gen = sample_generator(cfg.seed, iteration, first, "dpo-timestep")
    return torch.sigmoid(torch.normal(d.logit_mean, d.logit_std, (1,), generator=gen))


def unshifted_sigma(u: torch.Tensor, timestep_range: tuple[float, float]) -> torch.Tensor:
    """Flow-Factory's noise level of a logit-normal draw at ``time_shift`` 1, in its float32 order
    of operations: ``frac = lo + clamp(u, 0.01, 1 - 1e-6) (hi - lo)``, ``t = 1000 (1 - frac)``,
    ``sigma = clamp(t / 1000, 0, 1)`` (utils/noise_schedule.py ``_raw_logit_normal_unit``,
    ``logit_normal_shifted``, ``flow_match_sigma``). u: [P]."""
    lo, hi = timestep_range
    frac = lo + torch.clamp(u, min=0.01, max=1.0 - 1e-6) * (hi - lo)
    return (1000.0 * (1.0 - frac) / 1000.0).clamp(0.0, 1.0)


def dpo_pair(advantages: list[float]) -> tuple[int, int] | None:
    """``(chosen, rejected)`` positions in ``advantages``: the first of the highest and the last
    of the lowest (a stable descending sort's first and last); None for fewer than two."""
    if len(advantages) < 2:
        return None
    order = sorted(range(len(advantages)), key=lambda i: advantages[i], reverse=True)
    return order[0], order[-1]


def dpo_pair_loss(
    v: torch.Tensor, v_ref: torch.Tensor, target: torch.Tensor, beta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Diffusion-DPO's loss of pairs laid out ``[chosen0, rejected0, chosen1, ...]``: ``(loss
    [P], inside [P])``. v: [2P, *latent] (with gradient); v_ref, target: [2P, *latent]."""
    v = at_least_float32(v)
    target = target.to(device=v.device, dtype=v.dtype)
    model_err = ((v - target) ** 2).flatten(1).mean(dim=1)
    ref_err = ((v_ref.detach().to(device=v.device, dtype=v.dtype) - target) ** 2).flatten(1).mean(dim=1)
    w_diff = model_err[0::2] - ref_err[0::2]
    l_diff = model_err[1::2] - ref_err[1::2]
    inside = -0.5 * beta * (w_diff - l_diff)
    return -F.logsigmoid(inside), inside.detach()


class OnlineDpo(CleanSampleFamily):
    name = "online-dpo"
    title = "Online Diffusion-DPO"
    order = 10
    peer = (
        "verl-project/verl-omni @a1139ba: verl_omni/trainer/diffusion/diffusion_algos.py DPOLoss + "
        "verl_omni/pipelines/utils.py sample_noise_and_timesteps"
    )
    summary = "Diffusion-DPO on each group's best/worst pair of clean samples against the base weights"
    rollout_needs = "a deterministic solver with CFG; no log-probs; the final latent only"

    def check(self, cfg: Config) -> list[str]:
        problems = self._lora_problems(cfg)
        if cfg.rollout.group_size < 2:
            problems.append(
                f"rollout.group_size ({cfg.rollout.group_size}) must be at least 2 for online-dpo: each group "
                "gives one chosen/rejected pair"
            )
        if cfg.train.kl_beta > 0:
            problems.append(
                f"train.kl_beta ({cfg.train.kl_beta}): online-dpo's reference is inside its loss; set "
                "train.kl_beta=0"
            )
        lo, hi = cfg.train.online_dpo.timestep_range
        if not 0.0 <= lo < hi <= 1.0:
            problems.append(
                f"train.online_dpo.timestep_range ({[lo, hi]}) must be [lo, hi] with 0 <= lo < hi <= 1 "
                "(fractions of the way from noise to clean)"
            )
        if cfg.train.zero_advantage == "drop":
            problems.append(
                "train.zero_advantage (drop): online-dpo pairs the best and the worst of every group, flat "
                "groups included (as VeRL-Omni); set train.zero_advantage=keep"
            )
        return problems + self._whole_group_problems(cfg) + self._kl_problems(cfg)

    def solver(self, cfg: Config) -> StepKind:
        return "dpm2" if cfg.train.online_dpo.solver == "dpm2" else "ode"

    def trained_steps(self, cfg: Config, iteration: int, sample_id: int) -> list[int]:
        """The group's one training-schedule index (the same for every sample of the group)."""
        u = pair_u(cfg, iteration, sample_id - sample_id % cfg.rollout.group_size)
        return [min(int((u * TRAIN_STEPS).long()), TRAIN_STEPS - 1)]

    def rows(self, spec: Any, traj: dict[str, torch.Tensor], cfg: Config) -> GroupRows:
        """The pair's two rows, chosen then rejected, sharing the group's noise and step;
        ``sigma`` is NaN (the loss reads the model's training schedule at ``step``), or the
        ``unshifted`` draw's continuous noise level."""
        final = traj["latents"][:, -1]
        pair = dpo_pair(spec.advantages)
        if pair is None:
            return GroupRows(
                x0=final[:0],
                noise=final[:0],
                sigma=torch.empty(0),
                advantage=torch.empty(0),
                sample=torch.empty(0, dtype=torch.long),
                step=torch.empty(0, dtype=torch.long),
                group=torch.empty(0, dtype=torch.long),
            )
        chosen, rejected = pair
        if spec.steps[chosen] != spec.steps[rejected]:
            raise AlgorithmError("online-dpo's pair must share its timestep (the group's draw)")
        first = spec.group * cfg.rollout.group_size
        gen = sample_generator(cfg.seed, spec.iteration, first, "dpo-noise")
        noise = torch.randn((1, *final.shape[1:]), generator=gen, dtype=torch.float32).to(final.dtype)
        idx = torch.tensor(pair, dtype=torch.long)
        d = cfg.train.online_dpo
        sigma = torch.full((2,), float("nan"))
        if d.timestep_draw == "unshifted":
            u = pair_u(cfg, spec.iteration, first)
            if min(int((u * TRAIN_STEPS).long()), TRAIN_STEPS - 1) != spec.steps[chosen][0]:
                raise AlgorithmError(
                    "online-dpo's unshifted noise level must come from the group's timestep draw"
                )
            sigma = unshifted_sigma(u, d.timestep_range).expand(2).clone()
        return GroupRows(
            x0=final.index_select(0, torch.tensor([spec.samples[i] for i in pair], dtype=torch.long)),
            noise=noise.expand(2, *final.shape[1:]).clone(),
            sigma=sigma,
            advantage=torch.tensor(spec.advantages, dtype=torch.float32)[idx],
            sample=idx,
            step=torch.tensor([spec.steps[chosen][0]] * 2, dtype=torch.long),
            group=torch.full((2,), spec.group, dtype=torch.long),
        )

    def loss(
        self, policy: FlowPolicy, rows: GroupRows, embeds: PromptEmbeds, cfg: Config, sigma_max: float
    ) -> tuple[torch.Tensor, LossTerms, torch.Tensor]:
        """One pair: its DPO loss on each of its two rows."""
        rows.one_group_step()
        g = cfg.rollout.guidance_scale
        device = policy.device
        if cfg.train.online_dpo.timestep_draw == "unshifted":
            sigma = rows.sigma.to(device, non_blocking=True)
        else:
            sigma = policy.sigmas(TRAIN_STEPS).to(device)[rows.step.to(device, non_blocking=True)]
        x0, noise = rows.x0.to(device, non_blocking=True), rows.noise.to(device, non_blocking=True)
        e = embeds.index(rows.sample)
        xt, target = noised(x0, noise, sigma), flow_target(x0, noise)
        with torch.no_grad(), policy.reference_mode():
            v_ref = policy.velocity(xt, sigma, e, g)
        v = policy.velocity(xt, sigma, e, g, cfg_grad=cfg.train.cfg_grad)
        pair_loss, _ = dpo_pair_loss(v, v_ref, target, cfg.train.online_dpo.beta)
        loss = pair_loss.repeat_interleave(2)
        ones = torch.ones_like(loss.detach())
        terms = LossTerms(
            loss=loss, ratio=ones, clipped=torch.zeros_like(ones, dtype=torch.bool), approx_kl=0 * ones
        )
        return loss, terms, torch.zeros_like(loss)


ALGORITHM = OnlineDpo()
