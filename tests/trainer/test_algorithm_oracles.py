"""Every registered algorithm's update equals its peer's, every optimizer step of an iteration.

Each peer's training loop is restated here from its published code (written anew, not
copied: the formulas are cited in the algorithm modules) and run on the same tiny SD3
transformer, LoRA, trajectories and advantages as digen's own path: trajectories from
:func:`digen.rollout.generate_group` (the algorithm's rollout plan and storage), advantages
and trained steps from :class:`digen.iteration.IterationBook`, each group trained as two half
tasks with :func:`digen.training.train_group` (TSP packing on and off), one AdamW step per
mini-batch (:class:`digen.optim.ParameterStore`), versions loaded with
:func:`digen.algos.state.load_version`: the reference loop's order exactly.

Everything runs in float64 (``model.dtype: float64``; the float32-generated trajectories are
cast to float64 for both sides). Per mini-batch the mean gradient is compared (relative L2
error of the whole LoRA gradient), and after the iteration the weights' change. Both sides
keep float32 trainable weights (the peers' LoRA parameters are fp32; digen's store keeps
float32 masters). Measured: gradients at most 3.3e-15 apart, every mini-batch, TSP on and off;
the weights after the iteration equal (0.0). Asserted: 1e-6 (docs/guarantees.md). The cases use
losses scaled by powers of two (4 samples a step): the tiny model's backward has a float32
segment (its float32 timestep path), where an upstream gradient scaled by, say, 1/12 rounds
differently, which alone moves a gradient by ~5e-9. Mini-batch 1 trains off-policy (the weights moved after mini-batch 0): its
ratios are not 1 and the clip acts there.

Peers (commits read): Flow-GRPO and GRPO-Guard yifan123/flow_grpo @9745241 (mirror
Xianchao-Wu/flow_grpo), MixGRPO Tencent-Hunyuan/MixGRPO @e5cdd6a, Flow-DPPO
verl-project/verl-omni @a1139ba, DiffusionNFT NVlabs/DiffusionNFT @24af555.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from digen.algos.diffusion_nft import nft_decay
from digen.algos.state import load_version, role_weights, swapped_weights, with_role
from digen.assembly import build_policy
from digen.config import Config, build_config
from digen.iteration import IterationBook
from digen.optim import ParameterStore
from digen.rollout import generate_group
from digen.task_records import GroupTask, TrainStats
from digen.training import drawn_steps, spec_rows, train_group

G, GROUPS, PROMPT = 4, 2, "a red square"
TOLERANCE = 1e-6
ETA = 0.7  # Flow-GRPO's / MixGRPO's noise level
REWARDS = [[0.9, 0.1, 0.5, 0.2], [0.3, 0.8, 0.6, 0.1]]


@pytest.fixture(scope="module")
def world(tiny_sd3):
    """A float64 tiny SD3 with a random LoRA (B != 0: the policy differs from the base), and
    one prompt's embeddings (with the empty prompt's, for CFG)."""
    from tests.conftest import small_config_data

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    data = small_config_data(tiny_sd3)
    data["model"]["dtype"] = "float64"
    base = build_config(data)
    policy = build_policy(base)
    gen = torch.Generator().manual_seed(7)
    lora = {k: 0.05 * torch.randn(v.shape, generator=gen) for k, v in policy.trainable_state_dict().items()}
    policy.load_trainable_state_dict(lora)
    yield policy, policy.encode_prompts([PROMPT], with_uncond=True), base, lora
    torch.set_num_threads(threads)


@pytest.fixture
def policy(world):
    """The world's policy, its LoRA restored after the test (the peers' loops step it)."""
    policy, _, _, lora = world
    policy.load_trainable_state_dict(lora)
    load_version(policy, lora)
    yield policy
    policy.load_trainable_state_dict(lora)


def config(base: Config, *, steps: int, mini_batches: int, guidance: float = 1.0, **train) -> Config:
    data = base.model_dump()
    data["rollout"].update(num_steps=steps, group_size=G, batch_size=G * GROUPS, guidance_scale=guidance)
    data["rollout"]["sde"] = {"kind": "sde", "noise_level": ETA}
    data["train"].update(mini_batches=mini_batches, rows_per_forward=3, lr=1e-3, **train)
    return build_config(data)


# --- digen: the reference loop's order -------------------------------------------------------
@dataclass
class Iteration:
    book: IterationBook
    grads: list[dict[str, torch.Tensor]]  # mean gradient of each mini-batch
    stats: list[TrainStats]
    start: dict[str, torch.Tensor]  # trained weights before the iteration
    end: dict[str, torch.Tensor]  # after it
    store: ParameterStore


def generate(policy, embeds, cfg: Config) -> list[dict[str, torch.Tensor]]:
    """The algorithm's own rollouts of the iteration's groups, cast to float64."""
    out = []
    for g in range(GROUPS):
        task = GroupTask(0, g, PROMPT, tuple(range(g * G, (g + 1) * G)), 0)
        traj = generate_group(
            policy, task, cfg, lambda images, prompts, g=g: torch.tensor(REWARDS[g]), embeds=embeds
        )
        out.append({k: v.double() if v.is_floating_point() else v for k, v in traj.tensors().items()})
    return out


def digen_iteration(policy, embeds, cfg: Config, trajs, *, tsp: bool, store: ParameterStore) -> Iteration:
    groups = [GroupTask(0, g, PROMPT, tuple(range(g * G, (g + 1) * G)), 0) for g in range(GROUPS)]
    book = IterationBook(cfg, 0, groups)
    for g in range(GROUPS):
        book.add_rewards(g, torch.tensor(REWARDS[g]))
    load_version(policy, store.weights())
    start, grads, stats = store.trained(), [], []
    for m in range(cfg.train.mini_batches):
        total = TrainStats()
        for g in [g for g in book.trainable_groups() if book.mini_batch(g) == m]:
            for part in (0, 1):
                spec = book.task_spec(g, part)
                grad, st = train_group(policy, spec, trajs[g], embeds, cfg, tsp=tsp)
                book.add_gradient(g, grad, st, part)
                total.add(st)
        summed, rows = book.gradient(m)
        grads.append({k: v / rows for k, v in summed.items()})
        stats.append(total)
        store.step(summed, rows, last_of_iteration=m == cfg.train.mini_batches - 1)
        load_version(policy, store.weights())
    return Iteration(book, grads, stats, start, store.trained(), store)


# --- the peers' common parts, restated -------------------------------------------------------
def peer_velocity(policy, x, sigma, embeds, guidance: float) -> torch.Tensor:
    """Flow-GRPO ``compute_log_prob``'s transformer call: one ``[uncond; cond]`` forward with
    CFG, ``uncond + s (cond - uncond)``; timestep 1000 sigma in float32."""
    tr, n = policy.transformer, x.shape[0]
    cond = embeds.tensors["encoder_hidden_states"].expand(n, -1, -1)
    pooled = embeds.tensors["pooled_projections"].expand(n, -1)
    t = sigma.float() * 1000.0
    if guidance <= 1.0:
        return tr(
            hidden_states=x,
            timestep=t,
            encoder_hidden_states=cond,
            pooled_projections=pooled,
            return_dict=False,
        )[0]
    neg = embeds.uncond["encoder_hidden_states"].expand(n, -1, -1)
    neg_pooled = embeds.uncond["pooled_projections"].expand(n, -1)
    out = tr(
        hidden_states=torch.cat([x, x]),
        timestep=torch.cat([t, t]),
        encoder_hidden_states=torch.cat([neg, cond]),
        pooled_projections=torch.cat([neg_pooled, pooled]),
        return_dict=False,
    )[0]
    uncond, text = out.chunk(2)
    return uncond + guidance * (text - uncond)


def peer_sde_step(v, x, x_next, sigma, sigma_next, sigma_max):
    """Flow-GRPO ``sde_step_with_logprob`` (``sde_type='sde'``, ``return_sqrt_dt``) and
    MixGRPO ``flow_grpo_step``: (log_prob [n], prev_sample_mean, std_dev_t, sqrt(-dt))."""
    s, sn = sigma.view(-1, 1, 1, 1), sigma_next.view(-1, 1, 1, 1)
    dt = sn - s
    std = torch.sqrt(s / (1 - torch.where(s == 1, torch.full_like(s, sigma_max), s))) * ETA
    mean = x * (1 + std**2 / (2 * s) * dt) + v * (1 + std**2 * (1 - s) / (2 * s)) * dt
    width = std * torch.sqrt(-dt)
    lp = -((x_next - mean) ** 2) / (2 * width**2) - torch.log(width) - math.log(math.sqrt(2 * math.pi))
    return lp.mean(dim=(1, 2, 3)), mean, std, torch.sqrt(-dt)


class PeerOptimizer:
    """The peers' ``clip_grad_norm_`` + ``torch.optim.AdamW`` over the LoRA weights. Their
    trainable weights are float32 (accelerate / DDP keep LoRA parameters in fp32 under mixed
    precision), so it steps float32 copies and writes them into the float64 model."""

    def __init__(self, policy, cfg: Config):
        t = cfg.train
        self.policy, self.clip = policy, t.grad_clip
        self.params = [p for _, p in policy.named_trainable_parameters()]
        self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.opt = torch.optim.AdamW(
            self.masters, lr=t.lr, betas=t.betas, eps=t.adam_eps, weight_decay=t.weight_decay
        )

    def step(self) -> dict[str, torch.Tensor]:
        """Record the accumulated gradient, then step; the model's ``.grad`` is cleared."""
        grads = {n: p.grad.detach().clone() for n, p in self.policy.named_trainable_parameters()}
        for m, p in zip(self.masters, self.params, strict=True):
            m.grad = p.grad.float()
            p.grad = None
        torch.nn.utils.clip_grad_norm_(self.masters, self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for m, p in zip(self.masters, self.params, strict=True):
                p.copy_(m)
        return grads


def offsets(steps: int) -> torch.Tensor:
    """``[G, steps]`` log-prob offsets (-3e-4, 0, 3e-4): rows outside the trust region."""
    return torch.tensor(
        [[3e-4 * ((b + j) % 3 - 1) for j in range(steps)] for b in range(G)], dtype=torch.float64
    )


def relative_error(ours: dict, theirs: dict) -> float:
    a = torch.cat([ours[k].flatten().double() for k in sorted(theirs)])
    b = torch.cat([theirs[k].flatten().double() for k in sorted(theirs)])
    return float((a - b).norm() / b.norm())


def assert_same_iteration(ours: Iteration, peer_grads: list, peer_weights: dict) -> list[float]:
    errors = [relative_error(g, p) for g, p in zip(ours.grads, peer_grads, strict=True)]
    assert all(e < TOLERANCE for e in errors), errors
    ours_delta = {k: ours.end[k].double() - ours.start[k].double() for k in ours.start}
    their_delta = {k: peer_weights[k].double() - ours.start[k].double() for k in ours.start}
    assert relative_error(ours_delta, their_delta) < TOLERANCE
    assert relative_error(peer_grads[0], peer_grads[-1]) > 1e-3  # the mini-batches really differ
    return errors


def peer_weights(policy) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in policy.named_trainable_parameters()}


# --- Flow-GRPO with mini-batches, and with the velocity KL (no CFG) -------------------------
@pytest.mark.parametrize("kl_target", [None, "velocity"])
@pytest.mark.parametrize("tsp", [True, False])
def test_flow_grpo_two_optimizer_steps_per_rollout_batch_equal_the_peer(world, policy, tsp, kl_target):
    """Flow-GRPO (scripts/train_sd3.py ``main``): its rollout batch rebatched into micro-batches
    (here of 2 samples), an optimizer step every ``gradient_accumulation_steps`` of them
    (here one group, 4 samples: 2 steps per batch, as its SD3.5 recipes), each backward
    ``loss / (micro_batches_per_step * K)``. With ``kl_target velocity``: the KL of its
    no-CFG recommendation, ``mean((v - v_ref)^2)`` (yifan123/flow_grpo issue #198)."""
    _, embeds, base, _ = world
    beta = 0.04 if kl_target else 0.0
    cfg = config(base, steps=4, mini_batches=2, kl_beta=beta, kl_target=kl_target, clip_range=1e-4)
    trajs = generate(policy, embeds, cfg)
    for traj in trajs:
        traj["log_probs"] = traj["log_probs"] + offsets(4)
    ours = digen_iteration(
        policy, embeds, cfg, trajs, tsp=tsp, store=ParameterStore(policy.trainable_state_dict(), cfg.train)
    )
    assert [s.rows for s in ours.stats] == [G * 2, G * 2]  # int(4 * 0.5) steps per sample
    assert all(0 < s.clipped < s.rows for s in ours.stats)  # the clip acts in both steps
    assert ours.stats[1].ratio_max_dev > 0  # mini-batch 1 trains off-policy

    policy.load_trainable_state_dict(ours.start)
    opt = PeerOptimizer(policy, cfg)
    grads = []
    for g in range(GROUPS):  # one optimizer step per group
        traj, spec = trajs[g], drawn_steps(ours.book.train_spec(g), cfg)
        adv = torch.tensor(spec.advantages, dtype=torch.float64).clamp(-5, 5)
        k = len(spec.steps[0])
        for idx in (torch.tensor([0, 1]), torch.tensor([2, 3])):
            for j in spec.steps[0]:
                x, x_next = traj["latents"][idx, j], traj["latents"][idx, j + 1]
                sig, sig_next = traj["sigmas"][j].expand(2), traj["sigmas"][j + 1].expand(2)
                v = peer_velocity(policy, x, sig, embeds, 1.0)
                logp, mean, std, _ = peer_sde_step(v, x, x_next, sig, sig_next, float(traj["sigmas"][1]))
                ratio = torch.exp(logp - traj["log_probs"][idx, j])
                loss = torch.mean(
                    torch.maximum(-adv[idx] * ratio, -adv[idx] * torch.clamp(ratio, 1 - 1e-4, 1 + 1e-4))
                )
                if kl_target:
                    with torch.no_grad(), policy.reference_mode():
                        v_ref = peer_velocity(policy, x, sig, embeds, 1.0)
                    loss = loss + beta * torch.mean(((v - v_ref) ** 2).mean(dim=(1, 2, 3)))
                (loss / (2 * k)).backward()
        grads.append(opt.step())
    assert_same_iteration(ours, grads, peer_weights(policy))


# --- Flow-GRPO's own mini-batch split: shuffled samples (train.mini_batch_split: samples) ------
@pytest.mark.parametrize("tsp", [True, False])
def test_flow_grpo_sample_split_equals_the_peer_with_its_order_forced_to_digens_draw(world, policy, tsp):
    """Flow-GRPO's inner epoch (scripts/train_sd3.py ``main``): zero-advantage samples masked
    out, random ones switched back on until the kept count divides ``num_batches_per_epoch``,
    the rest permuted along the batch (``torch.randperm``), reshaped into micro-batches (here
    of 1 sample) and stepped every ``gradient_accumulation_steps`` of them (here 1: 8 steps;
    ``mini_batches`` divides the 8 samples, as Flow-GRPO's micro-batches must).
    Its draws are forced to digen's (``torch.randperm`` with :func:`digen.seeding.generator`
    of digen's streams, which :func:`digen.seeding.permutation` restates); digen's side is
    the reference loop's (:func:`digen.reference.mini_batch_tasks`). Group 1 is flat: 4 kept
    samples, all 4 of the flat group switched back on, 8 steps of one sample each."""
    from digen.reference import mini_batch_tasks
    from digen.seeding import generator

    _, embeds, base, _ = world
    rewards, m_total, accumulation, k, beta = [[0.9, 0.1, 0.5, 0.2], [0.4] * G], 8, 1, 2, 0.04
    split = {"mini_batch_split": "samples", "zero_advantage": "drop"}
    cfg = config(base, steps=4, mini_batches=m_total, kl_beta=beta, kl_target="velocity", **split)
    trajs = []
    for g in range(GROUPS):
        task = GroupTask(0, g, PROMPT, tuple(range(g * G, (g + 1) * G)), 0)
        traj = generate_group(policy, task, cfg, lambda *_, g=g: torch.tensor(rewards[g]), embeds=embeds)
        t = {k: v.double() if v.is_floating_point() else v for k, v in traj.tensors().items()}
        t["log_probs"] = t["log_probs"] + offsets(4)
        trajs.append(t)
    groups = [GroupTask(0, g, PROMPT, tuple(range(g * G, (g + 1) * G)), 0) for g in range(GROUPS)]
    book = IterationBook(cfg, 0, groups)
    for g in range(GROUPS):
        book.add_rewards(g, rewards[g])
    store = ParameterStore(policy.trainable_state_dict(), cfg.train)
    start, grads, stats = store.trained(), [], []
    for m in range(m_total):  # the reference loop's order
        total = TrainStats()
        for g, part in mini_batch_tasks(book, m):
            spec = book.task_spec(g, part)
            if spec.samples:
                grad, st = train_group(policy, spec, trajs[g], embeds, cfg, tsp=tsp)
                book.add_gradient(g, grad, st, part)
                total.add(st)
        summed, rows = book.gradient(m)
        grads.append({n: v / rows for n, v in summed.items()})
        stats.append(total)
        store.step(summed, rows, last_of_iteration=m == m_total - 1)
        load_version(policy, store.weights())
    ours = Iteration(book, grads, stats, start, store.trained(), store)
    assert [s.rows for s in ours.stats] == [accumulation * k] * m_total
    assert {g for g, _ in book.sample_split()} == {0, 1} and book.zero_advantage_dropped == 0

    # the peer: every sample of the batch, its advantage and its trained steps (the same draws)
    keep = config(base, steps=4, mini_batches=1, kl_beta=beta, kl_target="velocity")
    full = IterationBook(keep, 0, groups)
    for g in range(GROUPS):
        full.add_rewards(g, rewards[g])
    specs = [drawn_steps(full.train_spec(g), keep) for g in range(GROUPS)]
    adv = torch.tensor([a for sp in specs for a in sp.advantages], dtype=torch.float64).clamp(-5, 5)
    steps = [st for sp in specs for st in sp.steps]
    mask = adv.abs() != 0
    micro_batches = m_total * accumulation  # num_batches_per_epoch
    if int(mask.sum()) % micro_batches:
        false = torch.where(~mask)[0]
        need = micro_batches - int(mask.sum()) % micro_batches
        mask[false[torch.randperm(len(false), generator=generator(cfg.seed, 0, "zero_advantage"))[:need]]] = (
            True
        )
    kept = torch.arange(GROUPS * G)[mask]
    kept = kept[torch.randperm(len(kept), generator=generator(cfg.seed, 0, "mini_batches"))]
    policy.load_trainable_state_dict(ours.start)
    load_version(policy, ours.start)
    opt, peer = PeerOptimizer(policy, cfg), []
    for i, n in enumerate(kept.reshape(micro_batches, -1)[:, 0].tolist()):
        g, b = divmod(n, G)
        traj, idx = trajs[g], torch.tensor([b])
        for j in steps[n]:
            x, x_next = traj["latents"][idx, j], traj["latents"][idx, j + 1]
            sig, sig_next = traj["sigmas"][j].expand(1), traj["sigmas"][j + 1].expand(1)
            v = peer_velocity(policy, x, sig, embeds, 1.0)
            logp, _, _, _ = peer_sde_step(v, x, x_next, sig, sig_next, float(traj["sigmas"][1]))
            ratio = torch.exp(logp - traj["log_probs"][idx, j])
            a = adv[n].expand(1)
            loss = torch.mean(torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - 1e-4, 1 + 1e-4)))
            with torch.no_grad(), policy.reference_mode():
                v_ref = peer_velocity(policy, x, sig, embeds, 1.0)
            loss = loss + beta * torch.mean(((v - v_ref) ** 2).mean(dim=(1, 2, 3)))
            (loss / (accumulation * k)).backward()
        if (i + 1) % accumulation == 0:
            peer.append(opt.step())
    assert_same_iteration(ours, peer, peer_weights(policy))


def test_velocity_kl_changes_the_gradient(world, policy):
    """The two KL targets give different updates (the test above can tell them apart)."""
    _, embeds, base, _ = world
    out = {}
    for target in ("mean", "velocity"):
        cfg = config(base, steps=4, mini_batches=1, kl_beta=0.5, kl_target=target)
        trajs = generate(policy, embeds, cfg)
        store = ParameterStore(policy.trainable_state_dict(), cfg.train)
        out[target] = digen_iteration(policy, embeds, cfg, trajs, tsp=True, store=store).grads[0]
        policy.load_trainable_state_dict(world[3])
    assert relative_error(out["mean"], out["velocity"]) > 1e-2


# --- MixGRPO ---------------------------------------------------------------------------------
@pytest.mark.parametrize("flash", [False, True])
@pytest.mark.parametrize("tsp", [True, False])
def test_mix_grpo_window_training_equals_the_peer(world, policy, tsp, flash):
    """MixGRPO (fastvideo/train_grpo_flux.py ``train_one_step``, ``training_strategy part``):
    per sample (batch 1), per window step, Flow-GRPO's step log-prob of the stored transition,
    ``mean(max(-A r, -A clamp(r))) / (gradient_accumulation_steps * len(window))``, a step
    every ``gradient_accumulation_steps`` samples (here one group's 4). The trajectory holds
    only the window; Flash's DPM-Solver++ after the window changes the samples, not this."""
    _, embeds, base, _ = world
    cfg = config(
        base,
        steps=8,
        mini_batches=2,
        algorithm="mix-grpo",
        clip_range=1e-4,
        mix_grpo={"window": 4, "iters_per_window": 1, "flash": flash, "flash_compress": 0.7},
    )
    trajs = generate(policy, embeds, cfg)
    window = list(range(4))  # iteration 0 starts at step 0 (MixGRPO's window of 4)
    for traj in trajs:
        assert traj["latents"].shape[1] == 5 and traj["log_probs"].shape[1] == 4  # the window only
        assert "first_step" not in traj  # it starts at 0
        traj["log_probs"] = traj["log_probs"] + offsets(4)
    ours = digen_iteration(
        policy, embeds, cfg, trajs, tsp=tsp, store=ParameterStore(policy.trainable_state_dict(), cfg.train)
    )
    assert all(drawn_steps(spec, cfg).steps == [window] * G for spec in ours.book.specs.values())
    assert all(0 < s.clipped < s.rows == G * 4 for s in ours.stats)

    policy.load_trainable_state_dict(ours.start)
    opt = PeerOptimizer(policy, cfg)
    grads = []
    for g in range(GROUPS):
        traj, adv = trajs[g], torch.tensor(ours.book.train_spec(g).advantages, dtype=torch.float64)
        for b in range(G):
            for j in window:
                x, x_next = traj["latents"][b : b + 1, j], traj["latents"][b : b + 1, j + 1]
                sig, sig_next = traj["sigmas"][j : j + 1], traj["sigmas"][j + 1 : j + 2]
                v = peer_velocity(policy, x, sig, embeds, 1.0)
                new_log_probs, *_ = peer_sde_step(v, x, x_next, sig, sig_next, float(traj["sigmas"][1]))
                a = adv[b].clamp(-5, 5)
                ratio = torch.exp(new_log_probs - traj["log_probs"][b, j])
                loss = torch.mean(torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - 1e-4, 1 + 1e-4)))
                (loss / (G * len(window))).backward()
        grads.append(opt.step())
    assert_same_iteration(ours, grads, peer_weights(policy))


# --- GRPO-Guard -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "tsp, kl_beta, window",
    [(True, 0.0, False), (True, 0.04, False), (False, 0.0, False), (False, 0.04, False), (True, 0.0, True)],
)
def test_grpo_guard_equals_the_peer(world, policy, tsp, kl_beta, window):
    """GRPO-Guard (scripts/train_sd3_GRPO_Guard.py ``main``, ``config.rationorm``) with CFG 4.5
    and clip 2e-6 (config/grpo_guard.py), micro-batches of ONE sample: the peer's
    ``mean(dim=tuple(range(1, log_prob.ndim)))`` of a ``[B]`` tensor reduces the batch too
    (digen/algos/grpo_guard.py), which with one sample is the per-sample bias digen uses."""
    _, embeds, base, _ = world
    cfg = config(
        base, steps=4, mini_batches=2, guidance=4.5, algorithm="grpo-guard", clip_range=2e-6, kl_beta=kl_beta,
        # VeRL-Omni's GRPO-Guard example samples SDE in a window of 2 (Euler elsewhere)
        timesteps={"strategy": "window", "window": 2, "window_range": [0, 4]} if window else base.train.timesteps.model_dump(),
    )  # fmt: skip
    trajs = generate(policy, embeds, cfg)
    gen = torch.Generator().manual_seed(5)
    scale = torch.tensor([1e-3, 0.0, 1e-5, 0.0], dtype=torch.float64).view(G, 1, 1, 1, 1)
    for traj in trajs:
        assert traj["means"].shape == traj["latents"][:, 1:].shape
        traj["log_probs"] = traj["log_probs"] + offsets(4)
        traj["means"] = traj["means"] + scale * torch.randn(
            traj["means"].shape, generator=gen, dtype=torch.float64
        )
    ours = digen_iteration(
        policy, embeds, cfg, trajs, tsp=tsp, store=ParameterStore(policy.trainable_state_dict(), cfg.train)
    )
    if window:  # the window's steps only are trained; the Euler steps keep no mean
        steps = drawn_steps(ours.book.train_spec(0), cfg).steps[0]
        assert len(steps) == 2 and trajs[0]["means"][:, steps].isfinite().all()
        assert trajs[0]["means"][:, [i for i in range(4) if i not in steps]].isnan().all()
    assert 0 < ours.stats[0].clipped < ours.stats[0].rows and ours.stats[1].clipped > 0
    assert ours.stats[1].ratio_max_dev > ours.stats[0].ratio_max_dev  # off-policy after the first step

    policy.load_trainable_state_dict(ours.start)
    opt = PeerOptimizer(policy, cfg)
    grads = []
    for g in range(GROUPS):
        traj, spec = trajs[g], drawn_steps(ours.book.train_spec(g), cfg)
        adv = torch.tensor(spec.advantages, dtype=torch.float64)
        k = len(spec.steps[0])
        for b in range(G):
            for j in spec.steps[b]:
                x, x_next = traj["latents"][b : b + 1, j], traj["latents"][b : b + 1, j + 1]
                sig, sig_next = traj["sigmas"][j : j + 1], traj["sigmas"][j + 1 : j + 2]
                v = peer_velocity(policy, x, sig, embeds, 4.5)
                log_prob, mean, std_dev_t, sqrt_dt = peer_sde_step(
                    v, x, x_next, sig, sig_next, float(traj["sigmas"][1])
                )
                a = adv[b : b + 1].clamp(-5, 5)
                sigma_t = std_dev_t.mean()
                bias = (mean - traj["means"][b : b + 1, j]).pow(2).mean(dim=tuple(range(1, log_prob.ndim)))
                bias = bias / (2 * (sqrt_dt.mean() * sigma_t) ** 2)
                ratio = torch.exp(
                    (log_prob - traj["log_probs"][b : b + 1, j] + bias) * (sqrt_dt.mean() * sigma_t)
                )
                loss = torch.mean(torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - 2e-6, 1 + 2e-6)))
                loss = loss / sqrt_dt.mean() ** 2
                if kl_beta > 0:
                    with torch.no_grad(), policy.reference_mode():
                        v_ref = peer_velocity(policy, x, sig, embeds, 4.5)
                        _, mean_ref, _, _ = peer_sde_step(
                            v_ref, x, x_next, sig, sig_next, float(traj["sigmas"][1])
                        )
                    kl = ((mean - mean_ref) ** 2).mean(dim=(1, 2, 3), keepdim=True) / (2 * std_dev_t**2)
                    loss = loss + kl_beta * torch.mean(kl)
                (loss / (G * k)).backward()
        grads.append(opt.step())
    assert_same_iteration(ours, grads, peer_weights(policy))


def test_grpo_guard_differs_from_flow_grpo(world, policy):
    """The normalised ratio and the 1/dt weights change the update (the oracle above can fail)."""
    _, embeds, base, lora = world
    out = {}
    for algorithm in ("flow-grpo", "grpo-guard"):
        cfg = config(base, steps=4, mini_batches=1, algorithm=algorithm, clip_range=0.5)
        trajs = generate(policy, embeds, cfg)
        store = ParameterStore(policy.trainable_state_dict(), cfg.train)
        out[algorithm] = digen_iteration(policy, embeds, cfg, trajs, tsp=True, store=store).grads[0]
        policy.load_trainable_state_dict(lora)
    assert relative_error(out["flow-grpo"], out["grpo-guard"]) > 0.1


# --- Flow-DPPO --------------------------------------------------------------------------------
@pytest.mark.parametrize("tsp", [True, False])
def test_flow_dppo_equals_the_peer(world, policy, tsp):
    """Flow-DPPO (VeRL-Omni ``FlowDPPOLoss.compute_loss``, ``add_kl_coefficient`` true): per
    micro-batch (here 2 samples at one timestep) ``mean(where(keep, -A r, 0))`` with the
    divergence mask, each backward ``loss / (micro_batches_per_step * K)``."""
    _, embeds, base, _ = world
    threshold = 1e-5
    cfg = config(base, steps=4, mini_batches=2, algorithm="flow-dppo", flow_dppo={"kl_threshold": threshold})
    trajs = generate(policy, embeds, cfg)
    gen = torch.Generator().manual_seed(5)
    scale = torch.tensor([3e-2, 0.0, 1e-4, 1e-2], dtype=torch.float64).view(G, 1, 1, 1, 1)
    for traj in trajs:
        traj["log_probs"] = traj["log_probs"] + offsets(4)
        traj["means"] = traj["means"] + scale * torch.randn(
            traj["means"].shape, generator=gen, dtype=torch.float64
        )
    ours = digen_iteration(
        policy, embeds, cfg, trajs, tsp=tsp, store=ParameterStore(policy.trainable_state_dict(), cfg.train)
    )
    assert all(0 < s.clipped < s.rows for s in ours.stats)  # some updates masked, some kept

    policy.load_trainable_state_dict(ours.start)
    opt = PeerOptimizer(policy, cfg)
    grads = []
    for g in range(GROUPS):
        traj, spec = trajs[g], drawn_steps(ours.book.train_spec(g), cfg)
        advantages = torch.tensor(spec.advantages, dtype=torch.float64)
        k = len(spec.steps[0])
        for idx in (torch.tensor([0, 1]), torch.tensor([2, 3])):
            for j in spec.steps[0]:
                x, x_next = traj["latents"][idx, j], traj["latents"][idx, j + 1]
                sig, sig_next = traj["sigmas"][j].expand(2), traj["sigmas"][j + 1].expand(2)
                v = peer_velocity(policy, x, sig, embeds, 1.0)
                log_prob, mean, std_dev_t, sqrt_dt = peer_sde_step(
                    v, x, x_next, sig, sig_next, float(traj["sigmas"][1])
                )
                a = advantages[idx]
                ratio = torch.exp(log_prob - traj["log_probs"][idx, j])
                unclipped_loss = -a * ratio
                sigma_t = std_dev_t * sqrt_dt.reshape(2, 1, 1, 1)
                kl_per_sample = ((mean - traj["means"][idx, j]).pow(2) / (2 * sigma_t.pow(2))).mean(
                    dim=(1, 2, 3)
                )
                high = kl_per_sample >= threshold
                rm = (high & (ratio > 1.0) & (a > 0)) | (high & (ratio < 1.0) & (a < 0))
                loss = torch.mean(
                    torch.where(~rm.detach(), unclipped_loss, torch.zeros((), dtype=ratio.dtype))
                )
                (loss / (2 * k)).backward()
        grads.append(opt.step())
    assert_same_iteration(ours, grads, peer_weights(policy))


# --- DiffusionNFT -----------------------------------------------------------------------------
@pytest.mark.parametrize("kl_beta", [0.0, 1e-2])
@pytest.mark.parametrize("tsp", [True, False])
def test_diffusion_nft_equals_the_peer(world, policy, tsp, kl_beta):
    """DiffusionNFT (scripts/train_nft_sd3.py ``main``): micro-batches of 2 samples, for each
    trained-timestep position the noised clean latent, the old adapter's and the policy's
    velocities, the implicit positive/negative losses with adaptive weights, ``C (r L+ +
    (1 - r) L-) / beta`` averaged, ``+ train.beta mean((v - v_ref)^2)``, each backward
    ``loss / (gradient_accumulation_steps * K)``; a step per group (2 per rollout batch, as
    its ``sd3_ocr``). Then the old adapter's EMA with ``return_decay``. The peer's noise comes
    from ``randn_like``: both sides get digen's seeded noise."""
    _, embeds, base, lora = world
    beta, decay_type = 0.3, 1
    cfg = config(
        base,
        steps=4,
        mini_batches=2,
        algorithm="diffusion-nft",
        kl_beta=kl_beta,
        nft={"beta": beta, "decay_type": decay_type},
    )
    gen = torch.Generator().manual_seed(3)
    old = {k: v + 0.02 * torch.randn(v.shape, generator=gen) for k, v in lora.items()}
    store = ParameterStore(lora, cfg.train, state=with_role(old, "old"))
    load_version(policy, store.weights())
    trajs = generate(policy, embeds, cfg)  # sampled with the old weights
    for traj in trajs:
        assert (
            traj["latents"].shape[1] == 1 and traj["log_probs"].shape[1] == 0 and int(traj["first_step"]) == 4
        )
    ours = digen_iteration(policy, embeds, cfg, trajs, tsp=tsp, store=store)

    policy.load_trainable_state_dict(ours.start)
    opt = PeerOptimizer(policy, cfg)
    grads = []
    for g in range(GROUPS):
        spec = drawn_steps(ours.book.train_spec(g), cfg)
        noise = spec_rows(spec, trajs[g], cfg).noise  # [G * K, *latent], sample-major
        k = len(spec.steps[0])
        x0_all = trajs[g]["latents"][:, -1]
        adv_all = torch.tensor(spec.advantages, dtype=torch.float64)
        for idx in ([0, 1], [2, 3]):
            for j_idx in range(k):
                x0 = x0_all[idx]
                t = torch.stack([trajs[g]["sigmas"][spec.steps[b][j_idx]] for b in idx])
                te = t.view(-1, 1, 1, 1)
                eps = torch.stack([noise[b * k + j_idx] for b in idx]).double()
                xt = (1 - te) * x0 + te * eps
                with torch.no_grad(), swapped_weights(policy, old):  # set_adapter("old")
                    old_prediction = peer_velocity(policy, xt, t, embeds, 1.0).detach()
                forward_prediction = peer_velocity(policy, xt, t, embeds, 1.0)
                with torch.no_grad(), policy.reference_mode():  # disable_adapter()
                    ref_forward_prediction = peer_velocity(policy, xt, t, embeds, 1.0)
                r = torch.clamp((torch.clamp(adv_all[idx], -5, 5) / 5) / 2.0 + 0.5, 0, 1)
                positive = beta * forward_prediction + (1 - beta) * old_prediction
                negative = (1.0 + beta) * old_prediction - beta * forward_prediction
                x0_pred = xt - te * positive
                with torch.no_grad():
                    w = (
                        torch.abs(x0_pred.double() - x0.double())
                        .mean(dim=(1, 2, 3), keepdim=True)
                        .clip(min=1e-5)
                    )
                positive_loss = ((x0_pred - x0) ** 2 / w).mean(dim=(1, 2, 3))
                neg_pred = xt - te * negative
                with torch.no_grad():
                    w_neg = (
                        torch.abs(neg_pred.double() - x0.double())
                        .mean(dim=(1, 2, 3), keepdim=True)
                        .clip(min=1e-5)
                    )
                negative_loss = ((neg_pred - x0) ** 2 / w_neg).mean(dim=(1, 2, 3))
                policy_loss = ((r * positive_loss / beta + (1.0 - r) * negative_loss / beta) * 5).mean()
                kl = ((forward_prediction - ref_forward_prediction) ** 2).mean(dim=(1, 2, 3))
                loss = policy_loss + kl_beta * torch.mean(kl)
                (loss / (2 * k)).backward()
        grads.append(opt.step())
    theirs = peer_weights(policy)
    assert_same_iteration(ours, grads, theirs)
    # after the epoch: old <- d old + (1 - d) theta, d = return_decay(global_step = 2, type 1)
    d = nft_decay(2, decay_type)
    assert d == pytest.approx(0.002)
    their_old = {k: old[k].double() * d + theirs[k] * (1 - d) for k in old}
    our_old = role_weights(ours.store.state, "old")
    assert relative_error(our_old, their_old) < TOLERANCE
    assert relative_error(our_old, old) > 1e-4  # the old weights moved


def test_nft_decay_schedules_as_the_peer():
    """``return_decay``: type 0 never keeps the old weights, type 1 ramps 0.001 per step to
    0.5, type 2 copies for 75 steps then ramps 0.0075 per step to 0.999."""
    assert [nft_decay(s, 0) for s in (0, 10, 1000)] == [0.0, 0.0, 0.0]
    assert [nft_decay(s, 1) for s in (0, 10, 499, 10_000)] == pytest.approx([0.0, 0.01, 0.499, 0.5])
    assert [nft_decay(s, 2) for s in (74, 75, 76, 100, 1000)] == pytest.approx(
        [0.0, 0.0, 0.0075, 0.1875, 0.999]
    )
