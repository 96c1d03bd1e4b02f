"""Generation: one prompt group -> trajectories with behaviour log-probs, images, rewards.

A generation task is one *group* (``group_size`` samples of one prompt), always generated as
one batch, in every mode: the batch composition is then the same everywhere and the
distributed modes reproduce the reference trainer's samples bit for bit. A sample's noise
comes from its own stream (:mod:`digen.seeding`), so the group can run on any worker.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from digen.algos.sde import euler_step, sde_step
from digen.algos.timesteps import sde_step_mask, select_timesteps
from digen.config import Config
from digen.errors import TaskDropped
from digen.models.base import FlowPolicy, PromptEmbeds
from digen.rewards.base import call_reward
from digen.seeding import iteration_generator, sample_generator


@dataclass(frozen=True)
class GroupTask:
    """What a generation task says: which samples of which iteration, with which weights."""

    iteration: int
    group: int
    prompt: str
    sample_ids: tuple[int, ...]
    version: int

    def to_json(self) -> dict:
        return {
            "iteration": self.iteration,
            "group": self.group,
            "prompt": self.prompt,
            "sample_ids": list(self.sample_ids),
            "version": self.version,
        }

    @staticmethod
    def from_json(d: dict) -> GroupTask:
        return GroupTask(
            int(d["iteration"]),
            int(d["group"]),
            str(d["prompt"]),
            tuple(int(i) for i in d["sample_ids"]),
            int(d["version"]),
        )


@dataclass
class Trajectories:
    """A generated group.

    latents: ``[B, T+1, *latent]`` float32 (x_0 = noise ... x_T = final latent)
    log_probs: ``[B, T]`` float32 behaviour log-probs (NaN on ODE steps)
    sigmas: ``[T+1]`` float32 schedule
    images: ``[B, 3, H, W]`` uint8 (video ``[B, F, 3, H, W]``)
    rewards: ``[B]`` float32 (NaN/inf: the sample is dropped)
    decoded: the float32 images in ``[0, 1]`` the reward scores, kept only when a ``reward``
    task scores them (:func:`generate_group` without ``reward_fn``; rewards are NaN until then)
    """

    task: GroupTask
    latents: torch.Tensor
    log_probs: torch.Tensor
    sigmas: torch.Tensor
    images: torch.Tensor
    rewards: torch.Tensor
    decoded: torch.Tensor | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {
            "latents": self.latents.contiguous(),
            "log_probs": self.log_probs.contiguous(),
            "sigmas": self.sigmas.contiguous(),
            "images": self.images.contiguous(),
            "rewards": self.rewards.contiguous(),
        }
        if self.decoded is not None:
            out["decoded"] = self.decoded.contiguous()
        return out

    @staticmethod
    def from_tensors(task: GroupTask, t: dict[str, torch.Tensor]) -> Trajectories:
        return Trajectories(task, t["latents"], t["log_probs"], t["sigmas"], t["images"], t["rewards"])


def iteration_prompts(prompts: list[str], seed: int, iteration: int, count: int) -> list[str]:
    """The ``count`` prompts of an iteration: a seeded shuffle of the list, cycled."""
    order = torch.randperm(len(prompts), generator=iteration_generator(seed, iteration, "prompts")).tolist()
    return [prompts[order[i % len(order)]] for i in range(count)]


def plan_groups(cfg: Config, prompts: list[str], iteration: int, version: int) -> list[GroupTask]:
    """The generation tasks of one iteration, in group order."""
    g = cfg.rollout.group_size
    chosen = iteration_prompts(prompts, cfg.seed, iteration, cfg.rollout.prompts_per_iteration)
    return [
        GroupTask(iteration, i, p, tuple(range(i * g, (i + 1) * g)), version) for i, p in enumerate(chosen)
    ]


def window_steps(cfg: Config, iteration: int) -> list[int] | None:
    """The SDE window of an iteration (``window`` strategy), shared by all its samples."""
    ts = cfg.train.timesteps
    if ts.strategy != "window":
        return None
    gen = iteration_generator(cfg.seed, iteration, "window")
    return select_timesteps(
        cfg.rollout.num_steps, strategy="window", fraction=ts.fraction, window=ts.window, generator=gen
    )


def trained_steps(cfg: Config, iteration: int, sample_id: int) -> list[int]:
    """The denoising step indices one sample trains on (sorted)."""
    ts = cfg.train.timesteps
    if ts.strategy == "window":
        steps = window_steps(cfg, iteration)
        assert steps is not None
        return steps
    gen = sample_generator(cfg.seed, iteration, sample_id, "timesteps")
    return select_timesteps(
        cfg.rollout.num_steps, strategy=ts.strategy, fraction=ts.fraction, window=ts.window, generator=gen
    )


Timer = Callable[[str, float, float], None]
"""Called as ``timer(kind, start, end)`` for each phase (``gen``, ``decode``, ``reward``)."""


@torch.no_grad()
def generate_group(
    policy: FlowPolicy,
    task: GroupTask,
    cfg: Config,
    reward_fn: Callable[..., torch.Tensor] | None,
    embeds: PromptEmbeds | None = None,
    timer: Timer | None = None,
    stop: Callable[[], bool] | None = None,
) -> Trajectories:
    """Sample one group with the SDE sampler, decode it and score it (``reward_fn`` None: a
    ``reward`` task scores it later from ``decoded``; the ``reward`` phase is not timed). A
    true ``stop()``, checked before each denoising step, drops the group (:class:`TaskDropped`)."""
    r = cfg.rollout
    t0 = time.time()
    n = len(task.sample_ids)
    cfg_on = r.guidance_scale > 1.0
    if embeds is None:
        embeds = policy.encode_prompts([task.prompt], with_uncond=cfg_on)
    batch_embeds = embeds.repeat_rows(n)
    sigmas = policy.sigmas(r.num_steps).float().cpu()
    sigma_max = float(sigmas[1])
    window = window_steps(cfg, task.iteration)
    mask = sde_step_mask(r.num_steps, window or [], cfg.train.timesteps.strategy)

    gens = [sample_generator(cfg.seed, task.iteration, s, "noise") for s in task.sample_ids]
    if r.shared_noise:
        first = policy.initial_noise(gens[0])
        x = first.unsqueeze(0).repeat(n, *([1] * first.dim()))
        for g in gens[1:]:  # keep every stream at the same position
            policy.initial_noise(g)
    else:
        x = torch.stack([policy.initial_noise(g) for g in gens])
    latents = [x.cpu()]
    log_probs = []
    for i in range(r.num_steps):
        if stop is not None and stop():
            raise TaskDropped(
                f"group {task.group} of iteration {task.iteration} dropped at step {i}: the job stopped"
            )
        s, s_next = float(sigmas[i]), float(sigmas[i + 1])
        v = policy.velocity(x, torch.full((n,), s, device=x.device), batch_embeds, r.guidance_scale)
        eps = torch.stack([torch.randn(x.shape[1:], generator=g, dtype=torch.float32) for g in gens])
        if mask[i]:
            step = sde_step(
                v,
                x,
                s,
                s_next,
                kind=r.sde.kind,
                noise_level=r.sde.noise_level,
                noise=eps.to(x.device),
                sigma_max=sigma_max,
            )
            x, lp = step.prev_sample, step.log_prob
        else:
            x, lp = euler_step(v, x, s, s_next), torch.full((n,), float("nan"), device=x.device)
        latents.append(x.cpu())
        log_probs.append(lp.float().cpu())
    t1 = time.time()
    images = policy.decode(x).float().cpu()
    t2 = time.time()
    scored = reward_fn is not None
    if not scored:  # a reward worker scores the stored images
        rewards = torch.full((n,), float("nan"))
    else:
        meta = cfg.prompt_metadata(task.prompt)  # GenEval-style datasets: the rewards get it
        rewards = call_reward(reward_fn, images, [task.prompt] * n, None if meta is None else [meta] * n)
        rewards = rewards.float().cpu()
    t3 = time.time()
    if timer is not None:
        timer("gen", t0, t1)
        timer("decode", t1, t2)
        if scored:
            timer("reward", t2, t3)
    return Trajectories(
        task=task,
        latents=torch.stack(latents, dim=1),
        log_probs=torch.stack(log_probs, dim=1),
        sigmas=sigmas,
        images=(images * 255).round().clamp(0, 255).to(torch.uint8),
        rewards=rewards,
        decoded=None if scored else images,
    )
