"""The clean-sample family beyond DiffusionNFT: one step of digen's loss on identical tensors
equals its authors' function, loss and gradient, to float32 round-off.

Each case runs digen's path (the algorithm's rollout through :func:`digen.rollout.generate_group`,
advantages and trained steps from :class:`digen.iteration.IterationBook`, each group's
gradient from :func:`digen.training.train_group`) and the authors' training loop restated
from their code at the commit named (written anew), on the same tiny SD3 transformer, LoRA,
EMA weights, clean latents, noise and timesteps, in float32 (the authors' precision for LoRA
training). Compared: the mean loss (relative error) and the mean gradient over the step's
rows (relative L2 error of the whole LoRA gradient and its cosine to the authors').
Measured on this tiny model (2 groups of 4, 2 trained steps each, TSP on and off, the three
cases): DGPO's gradient relative error 4.2e-8 to 5.4e-8, 1 - cosine at most 1.5e-15, loss
relative error 5.3e-8 to 2.1e-7; AWM's (three weightings) gradient relative error 4.6e-7 to
9.6e-7, 1 - cosine at most 4.5e-13, loss relative error at most 8.2e-7 (its loss is a
difference of near-equal terms: the advantages sum to about 0); online DPO's gradient 0.0
apart (the same forwards, one pair each), loss relative error 5.7e-8. Asserted: relative error 1e-5, cosine 1 - 1e-8 (float32 round-off of a
different summation order: digen sums per group and step, the authors per micro-batch).

Authors' code read: DGPO Luo-Yihong/DGPO @01ceb4b scripts/train_sd3_dgpo.py; AWM
scxue/advantage_weighted_matching @be51372 advantage_weighted_matching/scripts/train_sd3_awm.py;
online DPO verl-project/verl-omni @a1139ba verl_omni/trainer/diffusion/diffusion_algos.py
``DPOLoss`` and verl_omni/pipelines/utils.py.
"""

from __future__ import annotations

import pytest
import torch

from digen.algos.state import load_version, swapped_weights, with_role
from digen.assembly import build_policy
from digen.config import Config, build_config
from digen.iteration import IterationBook
from digen.rollout import generate_group
from digen.task_records import GroupTask, TrainStats
from digen.training import drawn_steps, spec_rows, train_group

G = 4
PROMPTS = ("a red square", "a blue circle")  # one per group: the authors group by prompt
REWARDS = [[0.9, 0.1, 0.5, 0.2], [0.3, 0.8, 0.6, 0.1]]
GUIDANCE = 4.5  # CFG at rollout (the DGPO recipes'), none in training


@pytest.fixture(scope="module")
def world(tiny_sd3):
    """A float32 tiny SD3 with a random LoRA (B != 0), an EMA copy a little away from it, and
    each prompt's embeddings (with the empty prompt's, for CFG at rollout)."""
    from tests.conftest import small_config_data

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    base = build_config(small_config_data(tiny_sd3))
    policy = build_policy(base)
    gen = torch.Generator().manual_seed(7)
    lora = {k: 0.05 * torch.randn(v.shape, generator=gen) for k, v in policy.trainable_state_dict().items()}
    old = {k: v + 0.01 * torch.randn(v.shape, generator=gen) for k, v in lora.items()}
    embeds = [policy.encode_prompts([p], with_uncond=True) for p in PROMPTS]
    yield policy, embeds, base, lora, old
    torch.set_num_threads(threads)


def config(base: Config, **train) -> Config:
    data = base.model_dump()
    data["rollout"].update(num_steps=4, group_size=G, batch_size=G * len(PROMPTS), guidance_scale=GUIDANCE)
    data["train"].update(rows_per_forward=3, **train)
    return build_config(data)


def digen_step(policy, embeds, cfg: Config, *, tsp: bool, state: dict):
    """Rollouts, the book, and each group's train task: (trajectories, book, mean gradient, stats)."""
    load_version(policy, state)
    tasks = [GroupTask(0, g, PROMPTS[g], tuple(range(g * G, (g + 1) * G)), 0) for g in range(len(PROMPTS))]
    trajs = []
    for g, task in enumerate(tasks):
        traj = generate_group(
            policy, task, cfg, lambda images, prompts, g=g: torch.tensor(REWARDS[g]), embeds=embeds[g]
        )
        trajs.append(traj.tensors())
    book = IterationBook(cfg, 0, tasks)
    for g in range(len(tasks)):
        book.add_rewards(g, torch.tensor(REWARDS[g]))
    total, grads = TrainStats(), []
    for g in range(len(tasks)):
        grad, st = train_group(policy, book.task_spec(g, None), trajs[g], embeds[g], cfg, tsp=tsp)
        grads.append(grad)
        total.add(st)
    mean = {k: sum(gr[k] for gr in grads) / total.rows for k in grads[0]}
    return trajs, book, mean, total


def compare(ours: dict, theirs: dict) -> tuple[float, float]:
    a = torch.cat([ours[k].flatten().double() for k in sorted(theirs)])
    b = torch.cat([theirs[k].flatten().double() for k in sorted(theirs)])
    return float((a - b).norm() / b.norm()), float(torch.nn.functional.cosine_similarity(a, b, dim=0))


def cond_velocity(policy, x, sigma, embeds) -> torch.Tensor:
    """The authors' ``predict_v(..., cfg=False)``: the conditional branch, timestep 1000 sigma."""
    n = x.shape[0]
    return policy.transformer(
        hidden_states=x,
        timestep=sigma.float() * 1000.0,
        encoder_hidden_states=embeds.tensors["encoder_hidden_states"].expand(n, -1, -1),
        pooled_projections=embeds.tensors["pooled_projections"].expand(n, -1),
        return_dict=False,
    )[0]


# --- DGPO ---------------------------------------------------------------------------------------
def dgpo_authors_loss(model_v, ref_v, target_v, advantages, group_ids, beta_dpo, group_size, dsm_loss):
    """``compute_group_dgpo_loss_allreduce`` on one process (its all-reduce is the identity)."""
    n = model_v.shape[0]
    with torch.no_grad():
        ref_dsm_loss = (target_v - ref_v).square().reshape(n, -1).mean(dim=1)
    delta_diff = dsm_loss.detach() - ref_dsm_loss.detach()
    per_sample_term = advantages * beta_dpo * delta_diff / group_size
    num_groups = int(group_ids.max()) + 1
    sums = torch.zeros(num_groups, dtype=per_sample_term.dtype).scatter_add_(0, group_ids, per_sample_term)
    weights = torch.sigmoid(sums)[group_ids]
    return (weights.detach() * advantages * dsm_loss).mean(), torch.sigmoid(sums)


@pytest.mark.parametrize(
    "dgpo",
    [{}, {"use_ema_ref": True, "clip_range": 1e-5, "beta_dpo": 2e4}, {"clip_dsm": False}],
    ids=["base", "ema-ref", "noclip"],
)
@pytest.mark.parametrize("tsp", [True, False])
def test_dgpo_step_equals_the_authors(world, tsp, dgpo):
    """scripts/train_sd3_dgpo.py's training loop for one micro-batch of both groups (the
    authors' train batch is whole groups) over the shared sampled timesteps: per timestep the
    group-shared noise, ``x_t``, ``target = noise - x0``, the base weights' conditional
    velocity (``disable_adapter``), the ``ema_ref`` weights' (clip), the policy's; the
    advantage clamp; ``dsm``; the PPO-style clip of ``exp(old_dsm - dsm)``; the group loss;
    ``+ beta mean((v - v_ref)^2)``; each backward ``loss / M`` (accelerate's accumulation of
    the M timesteps into one step)."""
    policy, embeds, base, lora, old = world
    beta, clip_range = 0.02, dgpo.get("clip_range", 2e-4)
    cfg = config(
        base,
        algorithm="dgpo",
        kl_beta=beta,
        dgpo={"timesteps": 2, "trunc_steps": 2, "beta_dpo": 2000.0, **dgpo, "clip_range": clip_range},
    )
    state = {**lora, **with_role(old, "old")}
    policy.load_trainable_state_dict(lora)
    trajs, book, ours, stats = digen_step(policy, embeds, cfg, tsp=tsp, state=state)
    assert stats.rows == 2 * G * 2 and stats.forwards == 2 * 2  # a forward per (group, step)
    if dgpo.get("clip_dsm", True):
        assert 0 < stats.clipped < stats.rows  # the clip acts on some rows, not all

    # --- the authors' step on the same tensors
    policy.load_trainable_state_dict(lora)
    load_version(policy, state)
    params = dict(policy.named_trainable_parameters())
    for p in params.values():
        p.grad = None
    specs = [drawn_steps(book.train_spec(g), cfg) for g in range(2)]
    steps = specs[0].steps[0]
    assert all(s.steps == [steps] * G for s in specs) and len(steps) == 2  # shared by every sample
    x0 = torch.cat([t["latents"][:, -1] for t in trajs])
    noises = [
        spec_rows(s, t, cfg).noise.reshape(G, len(steps), *x0.shape[1:])
        for s, t in zip(specs, trajs, strict=True)
    ]
    for n in noises:
        assert torch.equal(n[0], n[-1])  # one noise per group and step
    adv_all = torch.tensor([a for s in specs for a in s.advantages])
    group_ids = torch.arange(2).repeat_interleave(G)
    d = cfg.train.dgpo
    total_loss = 0.0
    for k, j in enumerate(steps):
        sigma = trajs[0]["sigmas"][j].expand(2 * G)
        s4 = sigma.view(-1, 1, 1, 1)
        noise_diffuse = torch.cat([n[:, k] for n in noises])
        xt = (1 - s4) * x0 + s4 * noise_diffuse
        target_v = noise_diffuse - x0
        halves = [slice(0, G), slice(G, 2 * G)]

        def velocity(x, sigma=sigma, half=halves):
            return torch.cat([cond_velocity(policy, x[h], sigma[h], embeds[g]) for g, h in enumerate(half)])

        with torch.no_grad():
            with policy.reference_mode():  # transformer.module.disable_adapter()
                ref_old_v = velocity(xt)
            with swapped_weights(policy, old):  # ema_ref.copy_ema_to(...)
                old_v = velocity(xt)
        model_v = velocity(xt)
        ref_dgpo_v = old_v if d.use_ema_ref else ref_old_v
        advantages = torch.clamp(adv_all, -5, 5)
        dsm_loss = (target_v - model_v).square().reshape(2 * G, -1).mean(dim=1)
        old_dsm_loss = (target_v - old_v).square().reshape(2 * G, -1).mean(dim=1)
        ratio = torch.exp(-dsm_loss + old_dsm_loss)
        should_clip = torch.where(advantages > 0, ratio > 1.0 + clip_range, ratio < 1.0 - clip_range)
        if d.clip_dsm:
            dsm_loss = torch.where(should_clip, dsm_loss.detach(), dsm_loss)
        dgpo_loss, group_weights = dgpo_authors_loss(
            model_v, ref_dgpo_v, target_v, advantages, group_ids, d.beta_dpo, G, dsm_loss
        )
        assert float((group_weights - 0.5).abs().max()) > 0.05, group_weights  # the weight matters
        kl_loss = torch.mean((model_v - ref_old_v).square().reshape(2 * G, -1).mean(dim=1))
        loss = dgpo_loss + beta * kl_loss
        (loss / len(steps)).backward()
        total_loss += float(loss) / len(steps)
    theirs = {n: p.grad.detach().clone() for n, p in params.items()}
    for p in params.values():
        p.grad = None
    rel, cos = compare(ours, theirs)
    loss_rel = abs(stats.loss / stats.rows - total_loss) / abs(total_loss)
    assert rel < 1e-5 and cos > 1 - 1e-8 and loss_rel < 1e-5, (rel, cos, loss_rel)


# --- AWM ----------------------------------------------------------------------------------------
def awm_authors_log_prob(model_output, random_noise, clean_latents, timestep, weighting, power):
    """``compute_log_prob_awm`` after its transformer call (``train.cfg = False``)."""
    model_output = model_output.double()
    log_prob = -((model_output - (random_noise.double() - clean_latents.double())) ** 2)
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    t = timestep.view(-1)
    if weighting == "ghuber":
        floor = torch.pow(torch.tensor(1e-10, dtype=log_prob.dtype), power)
        return -(torch.pow(-log_prob + 1e-10, power) - floor) * t / power
    if weighting == "huber":
        return -(torch.sqrt(-log_prob + 1e-10) - 1e-5) * t
    return log_prob * t**2  # "t**2"


@pytest.mark.parametrize("weighting", ["ghuber", "huber", "t2"])
@pytest.mark.parametrize("tsp", [True, False])
def test_awm_step_equals_the_authors(world, tsp, weighting):
    """train_sd3_awm.py's on-policy step (``loss_type = exp_first``, ``off_policy = False``,
    one optimizer step per epoch): per row the noised clean latent, ``compute_log_prob_awm``,
    ``old_log_probs`` the same weights' detached, ``ratio = exp(logp - old)``, advantages
    ``clamp(A, +-5) / 5 * advantage_max``, ``max(-A r, -A clamp(r, 1 - c, 1 + c))`` averaged,
    ``+ beta mean((v - v_ref)^2) + ema_beta mean((v - v_ema)^2)`` (the ``ema`` adapter)."""
    policy, embeds, base, lora, old = world
    beta, ema_beta, power = 1e-3, 1.0, 0.25
    cfg = config(
        base,
        algorithm="awm",
        kl_beta=beta,
        awm={"timesteps": 2, "fraction": 1.0, "weighting": weighting, "ema_beta": ema_beta},
    )
    state = {**lora, **with_role(old, "old")}
    policy.load_trainable_state_dict(lora)
    trajs, book, ours, stats = digen_step(policy, embeds, cfg, tsp=tsp, state=state)
    assert stats.rows == 2 * G * 2 and stats.kl > 0

    policy.load_trainable_state_dict(lora)
    load_version(policy, state)
    params = dict(policy.named_trainable_parameters())
    for p in params.values():
        p.grad = None
    rows = [spec_rows(drawn_steps(book.train_spec(g), cfg), trajs[g], cfg) for g in range(2)]
    assert len({tuple(r.step.tolist()) for r in rows}) == 2 and all(bool((r.step >= 1).all()) for r in rows)
    timesteps = torch.cat([r.sigma for r in rows])
    clean_latents = torch.cat([r.x0 for r in rows])
    noise = torch.cat([r.noise for r in rows])
    t4 = timesteps.view(-1, 1, 1, 1)
    noised_latents = (1 - t4) * clean_latents + t4 * noise
    n = [len(r) for r in rows]

    def forward(x):
        parts = x.split(n)
        return torch.cat(
            [
                cond_velocity(policy, p, s, embeds[g])
                for g, (p, s) in enumerate(zip(parts, timesteps.split(n), strict=True))
            ]
        )

    with torch.no_grad():  # before the policy's forward: the EMA weights are swapped in place
        with policy.reference_mode():  # disable_adapter()
            model_output_ref = forward(noised_latents).double()
        with swapped_weights(policy, old):  # set_adapter("ema")
            model_output_ema = forward(noised_latents).double()
    model_output = forward(noised_latents)
    log_prob = awm_authors_log_prob(model_output, noise, clean_latents, timesteps, weighting, power)
    old_log_probs = log_prob.detach()
    advantages = torch.clamp(torch.cat([r.advantage for r in rows]).double(), -5, 5) / 5 * 1.0
    ratio = torch.exp(log_prob - old_log_probs.detach())
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - 1.0, 1.0 + 1.0)
    policy_loss = torch.mean(torch.maximum(unclipped_loss, clipped_loss))
    mo = model_output.double()
    kl_loss = ((mo - model_output_ref) ** 2).mean(dim=(1, 2, 3)).mean()
    ema_kl_loss = ((mo - model_output_ema) ** 2).mean(dim=(1, 2, 3)).mean()
    loss = policy_loss + beta * kl_loss + ema_beta * ema_kl_loss
    loss.backward()
    theirs = {k: p.grad.detach().clone() for k, p in params.items()}
    for p in params.values():
        p.grad = None
    rel, cos = compare(ours, theirs)
    loss_rel = abs(stats.loss / stats.rows - float(loss)) / abs(float(loss))
    assert rel < 1e-5 and cos > 1 - 1e-8 and loss_rel < 1e-5, (rel, cos, loss_rel)


# --- online Diffusion-DPO -----------------------------------------------------------------------
def cfg_velocity(policy, x, sigma, embeds, guidance) -> torch.Tensor:
    """The SD3 DPO adapter's forward with CFG: one ``[uncond; cond]`` pass, ``uncond + s (cond -
    uncond)``, timestep 1000 sigma."""
    tr, n = policy.transformer, x.shape[0]
    t = sigma.float() * 1000.0
    out = tr(
        hidden_states=torch.cat([x, x]),
        timestep=torch.cat([t, t]),
        encoder_hidden_states=torch.cat(
            [
                embeds.uncond["encoder_hidden_states"].expand(n, -1, -1),
                embeds.tensors["encoder_hidden_states"].expand(n, -1, -1),
            ]
        ),
        pooled_projections=torch.cat(
            [
                embeds.uncond["pooled_projections"].expand(n, -1),
                embeds.tensors["pooled_projections"].expand(n, -1),
            ]
        ),
        return_dict=False,
    )[0]
    uncond, text = out.chunk(2)
    return uncond + guidance * (text - uncond)


def dpo_authors_loss(noise, latent, model_noise_pred, ref_noise_pred, scores, beta):
    """``DPOLoss.compute_loss`` on adjacent ``chosen, rejected`` pairs."""
    assert not bool(torch.any(scores[0::2] < scores[1::2]))
    target = noise.float() - latent.float()
    model_err = ((model_noise_pred.float() - target) ** 2).flatten(1).mean(dim=1)
    ref_err = ((ref_noise_pred.float() - target) ** 2).flatten(1).mean(dim=1)
    w_diff = model_err[0::2] - ref_err[0::2]
    l_diff = model_err[1::2] - ref_err[1::2]
    inside_term = -0.5 * beta * (w_diff - l_diff)
    return -torch.nn.functional.logsigmoid(inside_term).mean()


def flow_factory_unshifted_sigma(generator: torch.Generator) -> torch.Tensor:
    """Flow-Factory's DPO noise level (X-GenGroup/Flow-Factory a0b2bc5, trainers/dpo.py l.443-453,
    l.565-566; utils/noise_schedule.py l.83-154, l.46-48): ``logit_normal_shifted`` with
    ``stratified=False``, ``logit_mean`` 0, ``logit_std`` 1, ``time_shift`` 1, ``timestep_range``
    0.99, then ``flow_match_sigma``."""
    u = torch.randn(1, generator=generator) * 1.0 + 0.0
    raw = torch.sigmoid(u)
    raw = 1.0 * raw / (1 + (1.0 - 1) * raw)
    raw = torch.clamp(raw, min=0.01, max=1.0 - 1e-6)
    frac = 0.0 + raw * (0.99 - 0.0)
    t = 1000.0 * (1.0 - frac)
    return (t / 1000.0).clamp(0.0, 1.0)


@pytest.mark.parametrize("tsp, draw", [(True, "schedule"), (False, "schedule"), (True, "unshifted")])
def test_online_dpo_step_equals_verl_omni(world, tsp, draw):
    """VeRL-Omni's online DPO step: ``build_online_dpo_pair_indices`` (per prompt, the top and the
    bottom reward, adjacent), one noise and one timestep per pair (``sample_noise_and_timesteps``,
    here digen's draws), the noised latents, the reference's prediction (base weights), the
    actor's with CFG (the SD3 DPO adapter at ``guidance_scale`` 4.5), ``compute_loss``. With
    ``timestep_draw: unshifted`` the pair's noise level is Flow-Factory's, restated
    (:func:`flow_factory_unshifted_sigma`), whose loss (trainers/dpo.py l.595-611) is the same."""
    from digen.algos.online_dpo import TRAIN_STEPS
    from digen.seeding import sample_generator

    policy, embeds, base, lora, _ = world
    beta = 2000.0  # VeRL-Omni's config default (the recipe: 100): the pairs' sigmoid far from 1/2
    cfg = config(base, algorithm="online-dpo", online_dpo={"beta": beta, "timestep_draw": draw})
    policy.load_trainable_state_dict(lora)
    trajs, book, ours, stats = digen_step(policy, embeds, cfg, tsp=tsp, state=dict(lora))
    assert stats.rows == 2 * 2 and stats.forwards == 2  # one pair per group, one forward each

    params = dict(policy.named_trainable_parameters())
    for p in params.values():
        p.grad = None
    specs = [drawn_steps(book.train_spec(g), cfg) for g in range(2)]
    chosen_rejected = []
    for g in range(2):  # build_online_dpo_pair_indices on the rewards
        order = sorted(range(G), key=lambda i: REWARDS[g][i], reverse=True)
        chosen_rejected.append((order[0], order[-1]))
    assert chosen_rejected == [(0, 1), (1, 3)]
    rows = [spec_rows(s, t, cfg) for s, t in zip(specs, trajs, strict=True)]
    assert [r.sample.tolist() for r in rows] == [list(p) for p in chosen_rejected]
    latent = torch.cat([trajs[g]["latents"][list(p), -1] for g, p in enumerate(chosen_rejected)])
    noise = torch.cat([r.noise for r in rows])
    assert torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])  # one per pair
    sigma = policy.sigmas(TRAIN_STEPS)[torch.cat([r.step for r in rows])]
    if draw == "unshifted":
        peer = [
            flow_factory_unshifted_sigma(sample_generator(cfg.seed, 0, g * G, "dpo-timestep"))
            for g in range(2)
        ]
        unshifted = torch.cat([p.expand(2) for p in peer])
        assert torch.equal(torch.cat([r.sigma for r in rows]), unshifted)  # the same float32 bits
        assert (unshifted - sigma).abs().min() > 1e-3  # and not the shifted schedule's
        sigma = unshifted
    s4 = sigma.view(-1, 1, 1, 1)
    noisy = (1.0 - s4) * latent + s4 * noise
    with torch.no_grad(), policy.reference_mode():
        ref = torch.cat(
            [
                cfg_velocity(policy, noisy[2 * g : 2 * g + 2], sigma[2 * g : 2 * g + 2], embeds[g], GUIDANCE)
                for g in range(2)
            ]
        )
    pred = torch.cat(
        [
            cfg_velocity(policy, noisy[2 * g : 2 * g + 2], sigma[2 * g : 2 * g + 2], embeds[g], GUIDANCE)
            for g in range(2)
        ]
    )
    scores = torch.tensor([REWARDS[g][i] for g, p in enumerate(chosen_rejected) for i in p])
    loss = dpo_authors_loss(noise, latent, pred, ref, scores, beta)
    loss.backward()
    theirs = {k: p.grad.detach().clone() for k, p in params.items()}
    for p in params.values():
        p.grad = None
    rel, cos = compare(ours, theirs)
    loss_rel = abs(stats.loss / stats.rows - float(loss)) / abs(float(loss))
    assert abs(float(loss) - 0.6931) > 0.01  # the sigmoid is away from 1/2: the margin counts
    assert rel < 1e-5 and cos > 1 - 1e-8 and loss_rel < 1e-5, (rel, cos, loss_rel)
