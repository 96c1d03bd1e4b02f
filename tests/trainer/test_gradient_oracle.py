"""One optimizer step of digen equals the peers' training step, down to the LoRA gradient.

The peers' losses are restated here from their published code (written anew, not copied) and
run on the same tiny SD3 transformer, LoRA weights, stored trajectories and advantages as
digen's :func:`digen.training.train_group`:

- Flow-GRPO (``sde``, ``cps``): yifan123/flow_grpo scripts/train_sd3.py, the training loop
  of ``main`` and ``compute_log_prob``; flow_grpo/diffusers_patch/sd3_sde_with_logprob.py
  ``sde_step_with_logprob``. Per micro-batch of samples and per trained timestep ``j`` (the
  first ``int(T * fraction)``): ``policy_loss = mean_b max(-A r, -A clamp(r, 1 +- eps))``,
  ``kl = mean_b(mean_elements((mean - mean_ref)**2) / (2 std_dev_t**2))``,
  ``loss = policy_loss + beta * kl``, back-propagated divided by accelerate's
  ``gradient_accumulation_steps = micro_batches * num_train_timesteps``.
- DanceGRPO (``dance``): XueZeyue/DanceGRPO fastvideo/train_grpo_flux.py ``train_one_step``,
  ``grpo_one_step`` and ``flux_step``. Per sample (batch 1) and per trained timestep:
  ``mean(max(-A r, -A clamp(r))) / (gradient_accumulation_steps * train_timesteps)``; no KL
  term (DanceGRPO has none). Its ``flux_step`` log-prob keeps only the quadratic term (the
  constants sit on a line of their own there, a no-op), which leaves ratios and gradients as
  a full Gaussian log density gives them.

CFG in the training forward follows Flow-GRPO's ``compute_log_prob``: one ``[uncond; cond]``
forward, ``uncond + s * (cond - uncond)``; ``train.cfg_grad: cond`` is its variant with
``noise_pred_uncond.detach()``. The old log-probs are each side's own log-prob of the stored
transition plus an offset that puts some rows outside the PPO trust region (clip active).

Tolerance: relative L2 error of the whole LoRA gradient. In float64 (``model.dtype:
float64``: model, LoRA, trajectories and digen's own trainer path, the ``world64`` fixture)
every case, CFG 4.5 included, agrees to at most 5.6e-15 (asserted: 1e-12): the math is the
peer's. In float32 what is left is round-off of differently batched forwards (TSP packs rows
of several timesteps, the peers batch one timestep), amplified by CFG's
``s * (cond - uncond)``: measured up to 6.8e-7 without CFG and 2.5e-6 with CFG 4.5 (asserted:
5e-6). Errors: ``oracle_errors`` per case, TSP on and off (docs/guarantees.md).
Every other family (FLUX, Qwen-Image, Wan, HunyuanVideo) runs the same float64 comparison on
its own tiny model, the peer's velocity restated from the family's diffusers pipeline call
(``PEER_VELOCITY``): a float64 model's velocity and gradient stay float64 in every family
(Wan with TSP to 1e-6: its diffusers blocks round to float32 inside, ``FLOAT32_INSIDE``).
Zero-advantage samples (``train.zero_advantage``): ``drop`` equals Flow-GRPO's filtered mean
and ``keep`` the unfiltered one, on a batch with a flat group. The AdamW step is checked
against ``torch.optim.AdamW`` + ``clip_grad_norm_`` over the LoRA tensors with each peer's
hyper-parameters, to 1e-6.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from digen.algos import select_timesteps
from digen.algos.sde import sde_step
from digen.assembly import build_policy
from digen.config import Config, build_config
from digen.iteration import IterationBook
from digen.optim import ParameterStore
from digen.task_records import GroupTask, TrainSpec, TrainStats
from digen.training import sum_gradients, train_group

G, T, SCALE, CLIP, BETA = 4, 4, 4.5, 1e-4, 0.04
ADVANTAGES = torch.tensor([1.3, -0.7, 0.4, -1.0])
# Offsets of the stored old log-probs: r = exp(offset); |offset| > CLIP leaves the trust region.
OFFSETS = torch.tensor(
    [[0.0, 3e-4, 0.0, 0.0], [-3e-4, 0.0, 0.0, 0.0], [0.0, 0.0, 3e-4, 0.0], [3e-4, -3e-4, 0.0, 0.0]]
)
NOISE = {"sde": 0.7, "cps": 0.8, "dance": 0.3}
TOLERANCE = 5e-6  # the float32 floor is ~2e-6 (module docstring)
FLOAT64_TOLERANCE = 1e-12  # measured at most 5.6e-15 (module docstring)
STEP_TOLERANCE = 1e-6


@dataclass(frozen=True)
class Case:
    kind: str
    cfg_grad: str | None  # None: no CFG in the training forward
    kl_beta: float

    @property
    def guidance(self) -> float:
        return SCALE if self.cfg_grad else 1.0


CASES = [
    Case(kind, cfg, kl)
    for kind in ("sde", "cps", "dance")
    for cfg in (None, "both", "cond")
    for kl in ((0.0, BETA) if kind != "dance" else (0.0,))
]


def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is fastest on a shared machine
    return threads


@pytest.fixture(scope="module")
def world(tiny_sd3):
    from tests.conftest import small_config_data

    threads = _one_thread()
    yield _world(build_config(small_config_data(tiny_sd3)))
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def world64(tiny_sd3):
    """The same world in float64 (``model.dtype: float64``): model, LoRA, trajectories and
    digen's trainer path, so what is left of a difference is the math, not round-off."""
    from tests.conftest import small_config_data

    threads = _one_thread()
    data = small_config_data(tiny_sd3)
    data["model"]["dtype"] = "float64"
    yield _world(build_config(data))
    torch.set_num_threads(threads)


def _world(cfg: Config):
    policy = build_policy(cfg)
    gen = torch.Generator().manual_seed(7)
    lora = {k: 0.05 * torch.randn(v.shape, generator=gen) for k, v in policy.trainable_state_dict().items()}
    policy.load_trainable_state_dict(lora)  # B != 0: the policy differs from the reference
    embeds = policy.encode_prompts(["a red square"], with_uncond=True)
    return policy, embeds, policy.sigmas(T).to(policy.dtype), cfg


def case_config(base: Config, case: Case, *, rows_per_forward: int = 3, **train) -> Config:
    data = base.model_dump()
    data["rollout"].update(guidance_scale=case.guidance, num_steps=T, group_size=G, batch_size=G)
    data["rollout"]["sde"] = {"kind": case.kind, "noise_level": NOISE[case.kind]}
    data["train"].update(
        kl_beta=case.kl_beta,
        cfg_grad=case.cfg_grad or "both",
        clip_range=CLIP,
        rows_per_forward=rows_per_forward,
        **train,
    )
    return build_config(data)


def trained_steps(kind: str) -> list[list[int]]:
    if kind == "dance":  # DanceGRPO: a per-sample random subset, the last step dropped
        return [
            select_timesteps(T, strategy="random", fraction=0.67, generator=torch.Generator().manual_seed(b))
            for b in range(G)
        ]
    return [select_timesteps(T, strategy="prefix", fraction=0.5)] * G  # Flow-GRPO: int(T * 0.5)


@torch.no_grad()
def rollout(policy, embeds, sigmas, case: Case, seed: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    """digen's own trajectories of the case, in the policy's precision: latents [G, T+1, ...],
    log-probs [G, T]."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((G, *policy.latent_shape()), generator=gen).to(sigmas.dtype)
    latents, log_probs = [x], []
    rows = embeds.repeat_rows(G)
    for i in range(T):
        v = policy.velocity(x, sigmas[i].expand(G), rows, case.guidance)
        step = sde_step(
            v, x, sigmas[i], sigmas[i + 1], kind=case.kind, noise_level=NOISE[case.kind],
            generator=gen, sigma_max=float(sigmas[1]),
        )  # fmt: skip
        x = step.prev_sample
        latents.append(x)
        log_probs.append(step.log_prob)
    return torch.stack(latents, 1), torch.stack(log_probs, 1)


# --- the peers, restated ---------------------------------------------------------------
def peer_velocity(policy, x, sigma, embeds, n: int, case: Case) -> torch.Tensor:
    """The velocity of ``n`` rows as the family's peer computes it (``PEER_VELOCITY``)."""
    return PEER_VELOCITY[policy.family](policy.transformer, policy, x, sigma, embeds, n, case)


def sd3_velocity(transformer, policy, x, sigma, embeds, n: int, case: Case) -> torch.Tensor:
    """Flow-GRPO ``compute_log_prob``'s transformer call (timestep = 1000 sigma, float32 as the
    scheduler's timesteps it passes)."""

    def prompt(tensors):
        return {
            "encoder_hidden_states": tensors["encoder_hidden_states"].expand(n, -1, -1),
            "pooled_projections": tensors["pooled_projections"].expand(n, -1),
        }

    return flow_grpo_forward(transformer, x, sigma.float() * 1000.0, prompt, embeds, case)


def flow_grpo_forward(transformer, x, t, prompt, embeds, case: Case) -> torch.Tensor:
    """Flow-GRPO ``compute_log_prob``'s forward: one pass on ``prompt(embeds.tensors)``
    without CFG; with CFG one ``[uncond; cond]`` forward, ``uncond + s * (cond - uncond)``, the
    uncond branch detached for ``cfg_grad: cond``."""
    cond = prompt(embeds.tensors)
    if case.cfg_grad is None:
        return transformer(hidden_states=x, timestep=t, **cond, return_dict=False)[0]
    neg = prompt(embeds.uncond)
    out = transformer(
        hidden_states=torch.cat([x, x]),
        timestep=torch.cat([t, t]),
        **{k: torch.cat([neg[k], cond[k]]) for k in cond},
        return_dict=False,
    )[0]
    noise_pred_uncond, noise_pred_text = out.chunk(2)
    if case.cfg_grad == "cond":
        noise_pred_uncond = noise_pred_uncond.detach()
    return noise_pred_uncond + SCALE * (noise_pred_text - noise_pred_uncond)


def flux_velocity(transformer, policy, x, sigma, embeds, n: int, case: Case) -> torch.Tensor:
    """``FluxPipeline.__call__``'s transformer call with guidance embedding (FLUX.1-dev: one
    pass, ``guidance`` float32): ``timestep = (1000 sigma).to(latents.dtype) / 1000``, all-zero
    ``txt_ids``, the pipeline's latent image ids."""
    from diffusers import FluxPipeline

    assert transformer.config.guidance_embeds  # the tiny FLUX is FLUX.1-dev-like
    prompt_embeds = embeds.tensors["encoder_hidden_states"].expand(n, -1, -1)
    h, w = policy.height // 16, policy.width // 16
    return transformer(
        hidden_states=x,
        timestep=(sigma.float() * 1000.0).to(x.dtype) / 1000,
        guidance=torch.full([1], case.guidance, dtype=torch.float32).expand(n),
        pooled_projections=embeds.tensors["pooled_projections"].expand(n, -1),
        encoder_hidden_states=prompt_embeds,
        txt_ids=torch.zeros(prompt_embeds.shape[1], 3).to(dtype=x.dtype),
        img_ids=FluxPipeline._prepare_latent_image_ids(1, h, w, x.device, x.dtype),
        return_dict=False,
    )[0]


def qwen_image_velocity(transformer, policy, x, sigma, embeds, n: int, case: Case) -> torch.Tensor:
    """``QwenImagePipeline.__call__``: a cond pass, then the negative prompt's pass, combined
    and rescaled per token to the cond norm; ``timestep = (1000 sigma).to(latents.dtype) /
    1000``; the prompt mask is dropped when nothing is padded."""

    def forward(tensors):
        mask = tensors["encoder_hidden_states_mask"].expand(n, -1)
        return transformer(
            hidden_states=x,
            timestep=(sigma.float() * 1000.0).to(x.dtype) / 1000,
            encoder_hidden_states_mask=None if mask.all() else mask,
            encoder_hidden_states=tensors["encoder_hidden_states"].expand(n, -1, -1),
            img_shapes=[[(1, policy.height // 16, policy.width // 16)]] * n,
            return_dict=False,
        )[0]

    noise_pred = forward(embeds.tensors)
    if case.cfg_grad is None:
        return noise_pred
    neg_noise_pred = forward(embeds.uncond)
    if case.cfg_grad == "cond":
        neg_noise_pred = neg_noise_pred.detach()
    comb_pred = neg_noise_pred + SCALE * (noise_pred - neg_noise_pred)
    cond_norm = torch.norm(noise_pred, dim=-1, keepdim=True)
    noise_norm = torch.norm(comb_pred, dim=-1, keepdim=True)
    return comb_pred * (cond_norm / noise_norm)


def wan_velocity(transformer, policy, x, sigma, embeds, n: int, case: Case) -> torch.Tensor:
    """``WanPipeline.__call__``'s transformer arguments (timestep = 1000 sigma, float32 as the
    scheduler's timesteps), the CFG branches as one ``[uncond; cond]`` forward as Flow-GRPO's
    ``compute_log_prob`` runs them (the pipeline runs two: diffusers' Wan blocks round their
    norms and residual adds to float32, so a float64 Wan agrees to 1e-12 only with a forward
    of the same rows, see ``FLOAT32_INSIDE``)."""

    def prompt(tensors):
        return {"encoder_hidden_states": tensors["encoder_hidden_states"].expand(n, -1, -1)}

    return flow_grpo_forward(transformer, x, sigma.float() * 1000.0, prompt, embeds, case)


def hunyuan_video_velocity(transformer, policy, x, sigma, embeds, n: int, case: Case) -> torch.Tensor:
    """``HunyuanVideoPipeline.__call__`` (guidance-distilled: one pass): timestep = 1000 sigma
    float32 (the pipeline's latents are float32), ``guidance = tensor([g] * n, dtype) *
    1000``, Llama states with their attention mask and CLIP's pooled output."""
    assert transformer.config.guidance_embeds
    return transformer(
        hidden_states=x,
        timestep=sigma.float() * 1000.0,
        encoder_hidden_states=embeds.tensors["encoder_hidden_states"].expand(n, -1, -1),
        encoder_attention_mask=embeds.tensors["encoder_attention_mask"].expand(n, -1),
        pooled_projections=embeds.tensors["pooled_projections"].expand(n, -1),
        guidance=torch.tensor([case.guidance] * n, dtype=x.dtype) * 1000.0,
        return_dict=False,
    )[0]


PEER_VELOCITY = {
    "sd3": sd3_velocity,
    "flux": flux_velocity,
    "qwen-image": qwen_image_velocity,
    "wan": wan_velocity,
    "hunyuan-video": hunyuan_video_velocity,
}


def peer_step(case: Case, v, x, x_next, sigma, sigma_next, sigma_max):
    """(log_prob [n], mean, std_dev_t) of the stored ``x_next``, in the peer's own form."""
    per_row = (-1,) + (1,) * (x.dim() - 1)  # [n, 1, ...]: sigmas broadcast over a latent
    s = sigma.view(per_row)
    sn = sigma_next.view(per_row)
    v = v.to(x.dtype)  # the stored latents' precision: float32, or float64 in world64
    if case.kind == "sde":  # Flow-GRPO sde_step_with_logprob, sde_type 'sde'
        dt = sn - s
        std = torch.sqrt(s / (1 - torch.where(s == 1, torch.full_like(s, sigma_max), s))) * NOISE["sde"]
        mean = x * (1 + std**2 / (2 * s) * dt) + v * (1 + std**2 * (1 - s) / (2 * s)) * dt
        width = std * torch.sqrt(-dt)
        lp = -((x_next - mean) ** 2) / (2 * width**2) - torch.log(width) - math.log(math.sqrt(2 * math.pi))
    elif case.kind == "cps":  # Flow-GRPO sde_step_with_logprob, sde_type 'cps'
        std = sn * math.sin(NOISE["cps"] * math.pi / 2)
        mean = (x - s * v) * (1 - sn) + (x + v * (1 - s)) * torch.sqrt(sn**2 - std**2)
        lp = -((x_next - mean) ** 2)
    else:  # DanceGRPO flux_step with sde_solver
        eta = NOISE["dance"]
        mean = x + (sn - s) * v
        score = -(x - (x - s * v) * (1 - s)) / s**2
        mean = mean + (-0.5 * eta**2 * score) * (sn - s)
        std = eta * torch.sqrt(s - sn)
        lp = -((x_next - mean) ** 2) / (2 * std**2)
    return lp.mean(dim=tuple(range(1, x.dim()))), mean, std


def peer_rows_loss(policy, embeds, sigmas, case: Case, latents, old, adv, idx, j):
    """The peer's loss of one forward: samples ``idx`` at timestep ``j``; also how many of
    its rows the clip silences (the clamped term is the max)."""
    tr = policy.transformer
    n = len(idx)
    x, x_next = latents[idx, j], latents[idx, j + 1]
    sigma, sigma_next = sigmas[j].expand(n), sigmas[j + 1].expand(n)
    logp, mean, std = peer_step(
        case, peer_velocity(policy, x, sigma, embeds, n, case), x, x_next, sigma, sigma_next, float(sigmas[1])
    )
    adv = torch.clamp(adv[idx].to(old.dtype), -5.0, 5.0)
    ratio = torch.exp(logp - old[idx, j])
    unclipped, clipped = -adv * ratio, -adv * torch.clamp(ratio, 1.0 - CLIP, 1.0 + CLIP)
    loss = torch.mean(torch.maximum(unclipped, clipped))
    if case.kl_beta > 0:
        with torch.no_grad():
            tr.disable_adapters()
            try:
                v_ref = peer_velocity(policy, x, sigma, embeds, n, case)
            finally:
                tr.enable_adapters()
            _, mean_ref, _ = peer_step(case, v_ref, x, x_next, sigma, sigma_next, float(sigmas[1]))
        kl = ((mean - mean_ref) ** 2).mean(dim=tuple(range(1, x.dim())), keepdim=True) / (2 * std**2)
        loss = loss + case.kl_beta * torch.mean(kl)
    return loss, int((clipped > unclipped).sum())


def peer_gradient(
    policy, embeds, sigmas, case: Case, latents, old, steps, adv=ADVANTAGES
) -> tuple[dict, int]:
    """The accumulated LoRA gradient of one peer optimizer step over all ``len(latents)``
    samples (advantages ``adv``)."""
    params = policy.named_trainable_parameters()
    for _, p in params:
        p.grad = None
    silenced, n = 0, len(latents)
    if case.kind == "dance":  # per sample, batch 1; loss / (gradient_accumulation_steps * K)
        for b in range(n):
            for j in steps[b]:
                loss, s = peer_rows_loss(
                    policy, embeds, sigmas, case, latents, old, adv, torch.tensor([b]), j
                )
                (loss / (n * len(steps[b]))).backward()
                silenced += s
    else:  # micro-batches of 2 samples; accelerate divides by micro_batches * K
        micro = [torch.tensor([i, i + 1]) for i in range(0, n, 2)]
        k = len(steps[0])
        for idx in micro:
            for j in steps[0]:
                loss, s = peer_rows_loss(policy, embeds, sigmas, case, latents, old, adv, idx, j)
                (loss / (len(micro) * k)).backward()
                silenced += s
    # a parameter the loss does not reach (Qwen-Image's last text-stream projections) has no .grad
    grads = {name: torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for name, p in params}
    for _, p in params:
        p.grad = None
    return grads, silenced


@torch.no_grad()
def peer_old_log_probs(policy, embeds, sigmas, case: Case, latents) -> torch.Tensor:
    """What the peer stores at generation: its own log-prob of each transition [n, T]."""
    n = len(latents)
    out = torch.empty(n, T, dtype=latents.dtype)
    for j in range(T):
        idx = torch.arange(n)
        sig, sig_next = sigmas[j].expand(n), sigmas[j + 1].expand(n)
        v = peer_velocity(policy, latents[:, j], sig, embeds, n, case)
        out[:, j] = peer_step(case, v, latents[:, j], latents[idx, j + 1], sig, sig_next, float(sigmas[1]))[0]
    return out


# --- digen ---------------------------------------------------------------------------
def trajectory(latents, log_probs, sigmas) -> dict[str, torch.Tensor]:
    """A group's trajectory dict as :func:`digen.training.train_group` reads it."""
    return {"latents": latents, "log_probs": log_probs, "sigmas": sigmas}


def digen_gradient(policy, embeds, sigmas, cfg: Config, latents, log_probs, steps, *, tsp: bool):
    """digen's mean gradient of the iteration: the group as two train tasks (halves), their
    sums added in order and divided by the trained rows, as ``ParameterStore.step`` does."""
    spec = TrainSpec(0, 0, 0, list(range(G)), list(range(G)), ADVANTAGES.tolist(), steps)
    parts = [
        train_group(policy, h, trajectory(latents, log_probs, sigmas), embeds, cfg, tsp=tsp)
        for h in (spec.half(0), spec.half(1))
    ]
    total = sum_gradients([g for g, _ in parts])
    rows = sum(s.rows for _, s in parts)
    return {k: v / rows for k, v in total.items()}, total, rows, sum(s.clipped for _, s in parts)


def relative_error(ours: dict, theirs: dict) -> float:
    a = torch.cat([ours[k].flatten().double() for k in sorted(theirs)])
    b = torch.cat([theirs[k].flatten().double() for k in sorted(theirs)])
    return float((a - b).norm() / b.norm())


def oracle_errors(world, case: Case) -> list[float]:
    """digen's gradient against the peer's, TSP on and off: the relative errors."""
    policy, embeds, sigmas, base = world
    latents, digen_lp = rollout(policy, embeds, sigmas, case)
    v = policy.velocity(latents[:, 0], sigmas[0].expand(G), embeds.repeat_rows(G), case.guidance)
    assert v.dtype == sigmas.dtype  # the world's precision: a float64 velocity is never float32
    steps = trained_steps(case.kind)
    theirs, silenced = peer_gradient(
        policy,
        embeds,
        sigmas,
        case,
        latents,
        peer_old_log_probs(policy, embeds, sigmas, case, latents) + OFFSETS,
        steps,
    )
    assert 0 < silenced < G * len(steps[0])  # the clip is active on some rows, not all
    assert relative_error(theirs, {k: torch.zeros_like(v) for k, v in theirs.items()}) > 0
    cfg = case_config(base, case)
    errors = []
    for tsp in (True, False):
        ours, _, rows, clipped = digen_gradient(
            policy, embeds, sigmas, cfg, latents, digen_lp + OFFSETS, steps, tsp=tsp
        )
        assert all(v.dtype == sigmas.dtype for v in ours.values())  # computed in the world's precision
        assert rows == sum(len(s) for s in steps)  # the mean runs over every (sample, timestep) row
        assert clipped == sum(int(OFFSETS[b, j] != 0) for b in range(G) for j in steps[b])
        errors.append(relative_error(ours, theirs))
    return errors


CASE_IDS = {"ids": lambda c: f"{c.kind}-cfg_{c.cfg_grad}-kl_{c.kl_beta}"}


@pytest.mark.parametrize("case", CASES, **CASE_IDS)
def test_one_step_gradient_equals_the_peers(world, case: Case) -> None:
    """float32: equal up to float32 round-off (``TOLERANCE``, module docstring)."""
    errors = oracle_errors(world, case)
    assert max(errors) < TOLERANCE, errors


@pytest.mark.parametrize("case", CASES, **CASE_IDS)
def test_one_step_gradient_equals_the_peers_in_float64(world64, case: Case) -> None:
    """float64: the same comparison to ``FLOAT64_TOLERANCE``, CFG 4.5 included: the math is
    the peer's; the float32 gap above is round-off."""
    errors = oracle_errors(world64, case)
    assert max(errors) < FLOAT64_TOLERANCE, errors


# --- every family in float64 ------------------------------------------------------------
FAMILY_MODELS = {  # each family's model settings besides the float64 dtype (video: 5 frames)
    "flux": {},
    "qwen-image": {},
    "wan": {"num_frames": 5},
    "hunyuan-video": {"num_frames": 5},
}
FLOAT32_INSIDE = {"wan": 1e-6}
"""Tolerance with TSP for a family whose diffusers transformer rounds to float32 inside even in
float64: ``WanTransformerBlock`` runs its norms and residual adds on ``hidden_states.float()``,
so rows batched otherwise than the peer's (TSP packs several timesteps in one forward) differ
at float32 round-off (measured up to 2.2e-7); forwards of the peer's rows agree to 1e-16."""
TRUE_CFG = ("qwen-image", "wan")  # the tiny FLUX and HunyuanVideo embed the guidance instead
FAMILY_CASES = [
    (family, case)
    for family in FAMILY_MODELS
    for case in (Case("sde", None, 0.0), Case("sde", "both", BETA))
    + ((Case("sde", "cond", 0.0),) if family in TRUE_CFG else ())
]


@pytest.fixture(scope="module")
def family_worlds64(tiny_models):
    """``family_worlds64(family)``: :func:`world64` for ``family``'s tiny model, built once."""
    from tests.conftest import small_config_data

    threads = _one_thread()
    worlds: dict = {}

    def get(family: str):
        if family not in worlds:
            data = small_config_data(tiny_models(family))
            data["model"].update(dtype="float64", **FAMILY_MODELS[family])
            worlds[family] = _world(build_config(data))
        return worlds[family]

    yield get
    torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "family, case", FAMILY_CASES, ids=lambda p: p if isinstance(p, str) else CASE_IDS["ids"](p)
)
def test_every_family_gradient_equals_its_pipeline_formula_in_float64(
    family_worlds64, family: str, case: Case
) -> None:
    """float64, every family: the velocity (true CFG on and off; FLUX and HunyuanVideo embed
    ``guidance_scale`` instead) stays float64 and the one-step gradient equals the peer loss
    over the family pipeline's own transformer call (``PEER_VELOCITY``) to
    ``FLOAT64_TOLERANCE``. A velocity rounded to float32 on the way leaves 2.6e-8 to 1e-7."""
    world = family_worlds64(family)
    policy, embeds, sigmas, _ = world
    assert policy.family == family and policy.dtype == sigmas.dtype == torch.float64
    v = policy.velocity(
        torch.randn(2, *policy.latent_shape()), sigmas[1].expand(2), embeds.repeat_rows(2), case.guidance
    )
    assert v.dtype == torch.float64 and not torch.equal(v, v.float().double())  # float64 digits kept
    tsp_on, tsp_off = oracle_errors(world, case)
    assert tsp_off < FLOAT64_TOLERANCE, tsp_off  # forwards of the peer's rows: the same math
    assert tsp_on < FLOAT32_INSIDE.get(family, FLOAT64_TOLERANCE), tsp_on


# --- zero-advantage samples ---------------------------------------------------------------
FLAT_REWARDS = [[0.9, 0.1, 0.5, 0.2], [0.5] * G]  # group 1 is flat: its advantages are exactly 0


def book_gradient(policy, embeds, sigmas, cfg: Config, trajectories) -> tuple[IterationBook, dict, int]:
    """digen's iteration of two groups (``FLAT_REWARDS``), each trained as two half tasks
    through :class:`IterationBook`, as the reference and the controller do; the mean gradient."""
    groups = [GroupTask(0, g, "a red square", tuple(range(g * G, (g + 1) * G)), 0) for g in range(2)]
    book = IterationBook(cfg, 0, groups)
    for g, rewards in enumerate(FLAT_REWARDS):
        book.add_rewards(g, torch.tensor(rewards))
    for g in book.trainable_groups():
        latents, log_probs = trajectories[g]
        for part in (0, 1):
            spec = book.task_spec(g, part)
            if spec.samples:
                grads, stats = train_group(
                    policy, spec, trajectory(latents, log_probs, sigmas), embeds, cfg, tsp=True
                )
            else:  # a task with no sample left: a zero gradient (the controller's release does the same)
                grads = {k: torch.zeros_like(v) for k, v in policy.trainable_state_dict().items()}
                stats = TrainStats()
            book.add_gradient(g, grads, stats, part)
    total, rows = book.gradient()
    return book, {k: v / rows for k, v in total.items()}, rows


@pytest.mark.parametrize("precision, mode", [("float64", "keep"), ("float64", "drop"), ("float32", "drop")])
def test_zero_advantage_samples_as_the_peers(request, precision: str, mode: str) -> None:
    """``train.zero_advantage``: ``drop`` = Flow-GRPO's filtered mean (train_sd3.py ``main``:
    samples whose advantages are all zero are masked out before rebatching; 4 kept samples
    divide ``num_batches_per_epoch`` 2, so it re-adds none), KL term and denominator included;
    ``keep`` = the mean over every sample (DanceGRPO ``train_one_step``, and Flow-GRPO
    without its filter)."""
    policy, embeds, sigmas, base = request.getfixturevalue("world64" if precision == "float64" else "world")
    case = Case("sde", "cond", BETA)
    cfg = case_config(base, case, zero_advantage=mode)
    trajectories = [rollout(policy, embeds, sigmas, case, seed=seed) for seed in (11, 12)]
    offsets = torch.cat([OFFSETS, OFFSETS])
    digen_trajectories = [(lat, lp + OFFSETS) for lat, lp in trajectories]
    book, ours, rows = book_gradient(policy, embeds, sigmas, cfg, digen_trajectories)

    # the peer: both groups' 8 samples, the advantages digen computed (the advantage formula
    # has its own oracle: tests/algos/test_peer_selection.py), then the peer's filter
    adv = torch.cat([torch.tensor(book.train_spec(0).advantages), torch.zeros(G)])
    latents = torch.cat([lat for lat, _ in trajectories])
    old = peer_old_log_probs(policy, embeds, sigmas, case, latents) + offsets
    keep = torch.nonzero(adv.abs() != 0).flatten() if mode == "drop" else torch.arange(2 * G)
    steps = trained_steps(case.kind)[:1] * len(keep)
    theirs, _ = peer_gradient(policy, embeds, sigmas, case, latents[keep], old[keep], steps, adv[keep])

    assert rows == len(keep) * len(steps[0])  # the mean's denominator: the rows that trained
    assert book.zero_advantage_dropped == (G if mode == "drop" else 0)
    assert book.metrics()["zero_advantage_dropped"] == book.zero_advantage_dropped
    tolerance = FLOAT64_TOLERANCE if precision == "float64" else TOLERANCE
    assert relative_error(ours, theirs) < tolerance
    if mode == "drop":  # the filter changes the step: the flat group's KL and the denominator
        everyone, _ = peer_gradient(policy, embeds, sigmas, case, latents, old, steps[:1] * 2 * G, adv)
        assert relative_error(ours, everyone) > 0.1


def test_cfg_grad_choice_changes_the_gradient(world) -> None:
    """The two CFG gradients really differ (the oracle above can tell them apart)."""
    policy, embeds, sigmas, base = world
    cond, both = Case("sde", "cond", 0.0), Case("sde", "both", 0.0)
    latents, lp = rollout(policy, embeds, sigmas, both)
    steps = trained_steps("sde")
    g_cond = digen_gradient(
        policy, embeds, sigmas, case_config(base, cond), latents, lp + OFFSETS, steps, tsp=True
    )[0]
    g_both = digen_gradient(
        policy, embeds, sigmas, case_config(base, both), latents, lp + OFFSETS, steps, tsp=True
    )[0]
    assert relative_error(g_cond, g_both) > 1e-2


@pytest.mark.parametrize(
    "peer, lr, weight_decay",
    [("flow-grpo", 3e-4, 1e-4), ("dance-grpo", 1e-5, 1e-4)],  # config/base.py; finetune_flux_grpo_8gpus.sh
)
@pytest.mark.parametrize("grad_scale", [1.0, 1e4])  # 1e4: the norm exceeds max_grad_norm 1.0
def test_adamw_step_equals_the_peers(
    world, peer: str, lr: float, weight_decay: float, grad_scale: float
) -> None:
    """``ParameterStore.step`` = the peers' ``clip_grad_norm_(trainable, 1.0)`` then
    ``torch.optim.AdamW(lr, betas (0.9, 0.999), eps 1e-8, weight_decay)`` on the mean gradient."""
    policy, embeds, sigmas, base = world
    case = Case("sde" if peer == "flow-grpo" else "dance", "both", 0.0)
    cfg = case_config(base, case)
    cfg.train.lr, cfg.train.weight_decay = lr, weight_decay
    latents, lp = rollout(policy, embeds, sigmas, case)
    steps = trained_steps(case.kind)
    mean, total, rows, _ = digen_gradient(policy, embeds, sigmas, cfg, latents, lp + OFFSETS, steps, tsp=True)
    weights = policy.trainable_state_dict()

    store = ParameterStore(weights, cfg.train)
    norm = store.step({k: v * grad_scale for k, v in total.items()}, rows)["grad_norm"]
    ours = store.weights()

    names = [n for n, _ in policy.named_trainable_parameters()]  # the peers' parameter order
    params = [torch.nn.Parameter(weights[n].clone()) for n in names]
    for n, p in zip(names, params, strict=True):
        p.grad = mean[n] * grad_scale
    their_norm = torch.nn.utils.clip_grad_norm_(params, max_norm=1.0)
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay)
    opt.step()
    theirs = {n: p.detach() for n, p in zip(names, params, strict=True)}

    assert math.isclose(norm, float(their_norm), rel_tol=1e-6)
    assert (norm > 1.0) == (grad_scale > 1.0)  # clipping active exactly in the scaled case
    # each weight within one float32 rounding of the peer's (an ulp of the weight: the two
    # optimizers round the same update in another order) plus STEP_TOLERANCE of its update. A
    # relative error of the updates alone is no test at lr 1e-5: an update of ~1e-5 on weights
    # of ~1 is a few hundred ulps, so one ulp of rounding is ~3e-6 of it, however exact the step
    eps = torch.finfo(torch.float32).eps
    for k in names:
        bound = (
            eps * torch.maximum(ours[k].abs(), theirs[k].abs())
            + STEP_TOLERANCE * (theirs[k] - weights[k]).abs()
        )
        assert bool(((ours[k] - theirs[k]).abs() <= bound).all()), k
    assert relative_error(ours, theirs) < STEP_TOLERANCE
