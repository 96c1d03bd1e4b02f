"""Generation: one prompt group -> trajectories with behaviour log-probs, images, rewards.

A generation task is one *group* (``group_size`` samples of one prompt), always generated as
one batch, in every mode: the batch composition is then the same everywhere and the
distributed modes reproduce the reference trainer's samples bit for bit. A sample's noise
comes from its own stream (:mod:`digen.seeding`), so the group can run on any worker.
Which groups an iteration samples is planned without torch (:func:`digen.tasks.plan_groups`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from digen.algos.dpm import dpm2_step
from digen.algos.registry import algorithm_for
from digen.algos.sde import euler_step, sde_step
from digen.config import Config
from digen.errors import TaskDropped
from digen.models.base import FlowPolicy, PromptEmbeds
from digen.rewards.base import call_reward
from digen.seeding import sample_generator
from digen.tasks import GroupTask


@dataclass
class Trajectories:
    """A generated group.

    latents: ``[B, S+1, *latent]`` float32, the stored latents ``x_first .. x_{first+S}``
        (Flow-GRPO: all of them, ``x_0`` = noise .. ``x_T`` = final latent; what an algorithm
        stores is its :class:`~digen.algos.registry.RolloutPlan`'s ``keep``)
    log_probs: ``[B, S]`` float32 behaviour log-probs of the stored steps (NaN on ODE steps)
    sigmas: ``[T+1]`` float32 schedule
    images: ``[B, 3, H, W]`` uint8 (video ``[B, F, 3, H, W]``)
    rewards: ``[B]`` float32 (NaN/inf: the sample is dropped)
    decoded: the float32 images in ``[0, 1]`` the reward scores, kept only when a ``reward``
    task scores them (:func:`generate_group` without ``reward_fn``; rewards are NaN until then)
    extra: the algorithm's other tensors (``first_step`` when the stored steps do not start at
        0, GRPO-Guard's ``means``): :attr:`digen.algos.registry.Algorithm.trajectory`
    """

    task: GroupTask
    latents: torch.Tensor
    log_probs: torch.Tensor
    sigmas: torch.Tensor
    images: torch.Tensor
    rewards: torch.Tensor
    decoded: torch.Tensor | None = None
    extra: dict[str, torch.Tensor] = field(default_factory=dict)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The flat dict a generation task stores and a train task reads (``train_group``)."""
        out = {
            "latents": self.latents.contiguous(),
            "log_probs": self.log_probs.contiguous(),
            "sigmas": self.sigmas.contiguous(),
            "images": self.images.contiguous(),
            "rewards": self.rewards.contiguous(),
        }
        out.update({k: v.contiguous() for k, v in self.extra.items()})
        if self.decoded is not None:
            out["decoded"] = self.decoded.contiguous()
        return out

    @staticmethod
    def from_tensors(task: GroupTask, t: dict[str, torch.Tensor]) -> Trajectories:
        extra = {k: v for k, v in t.items() if k not in _BASE_TENSORS}
        return Trajectories(
            task,
            t["latents"],
            t["log_probs"],
            t["sigmas"],
            t["images"],
            t["rewards"],
            t.get("decoded"),
            extra,
        )


_BASE_TENSORS = ("latents", "log_probs", "sigmas", "images", "rewards", "decoded")


def _initial_noise(policy: FlowPolicy, gens: list[torch.Generator], shared: bool) -> torch.Tensor:
    """``[n, *latent]`` starting noise, one stream per sample (``shared``: the first sample's
    for all, every stream still drawn once so their positions stay aligned)."""
    if shared:
        first = policy.initial_noise(gens[0])
        x = first.unsqueeze(0).repeat(len(gens), *([1] * first.dim()))
        for g in gens[1:]:  # keep every stream at the same position
            policy.initial_noise(g)
        return x
    return torch.stack([policy.initial_noise(g) for g in gens])


Timer = Callable[[str, float, float, float], None]
"""Called as ``timer(kind, start, end, cpu_s)`` for each phase (``gen``, ``decode``,
``reward``): wall-clock start and end, and the CPU seconds the calling thread spent in it
(:func:`time.thread_time`), which waiting for a core does not inflate (``digen bench``'s
bound on a machine with more busy workers than cores, :mod:`digen.bench.summary`)."""


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
    """Sample one group with the configured algorithm's rollout plan (Flow-GRPO: the SDE
    sampler on every step), decode it and score it (``reward_fn`` None: a ``reward`` task
    scores it later from ``decoded``; the ``reward`` phase is not timed). A true ``stop()``,
    checked before each denoising step, drops the group (:class:`TaskDropped`)."""
    r = cfg.rollout
    algo = algorithm_for(cfg)
    plan = algo.rollout_plan(cfg, task.iteration)
    t0, c0 = time.time(), time.thread_time()
    n = len(task.sample_ids)
    cfg_on = r.guidance_scale > 1.0
    if embeds is None:
        embeds = policy.encode_prompts([task.prompt], with_uncond=cfg_on)
    batch_embeds = embeds.repeat_rows(n)
    sigmas = policy.sigmas(r.num_steps).float().cpu()
    sigma_max = float(sigmas[1])
    path = sigmas if plan.schedule is None else sigmas[list(plan.schedule)]
    first, count = plan.keep

    gens = [sample_generator(cfg.seed, task.iteration, s, "noise") for s in task.sample_ids]
    with algo.sampling(policy):
        x = _initial_noise(policy, gens, r.shared_noise)
        latents = [x.cpu()] if first == 0 else []
        log_probs, means = [], []
        history = "dpm2" in plan.kinds  # DPM-Solver++(2M) needs the previous step's x0 prediction
        prev_x0: torch.Tensor | None = None
        for i, kind in enumerate(plan.kinds):
            if stop is not None and stop():
                raise TaskDropped(
                    f"group {task.group} of iteration {task.iteration} dropped at step {i}: the job stopped"
                )
            s, s_next = float(path[i]), float(path[i + 1])
            v = policy.velocity(x, torch.full((n,), s, device=x.device), batch_embeds, r.guidance_scale)
            eps = torch.stack([torch.randn(x.shape[1:], generator=g, dtype=torch.float32) for g in gens])
            x_in, mean = x, None
            if kind == "sde":
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
                x, lp, mean = step.prev_sample, step.log_prob, step.mean
            elif kind == "dpm2":
                s_prev = float(path[i - 1]) if i > 0 else None
                x, x0 = dpm2_step(v, x, s, s_next, prev_x0=prev_x0, sigma_prev=s_prev)
                lp = torch.full((n,), float("nan"), device=x.device)
            else:
                x, lp = euler_step(v, x, s, s_next), torch.full((n,), float("nan"), device=x.device)
            if history:
                prev_x0 = x0 if kind == "dpm2" else x_in.to(v.dtype) - s * v
            if first <= i < first + count:
                latents.append(x.cpu())
                log_probs.append(lp.float().cpu())
                if plan.means:
                    means.append(
                        (mean if mean is not None else torch.full_like(x, float("nan"))).float().cpu()
                    )
            elif i + 1 == first:  # the stored range starts after this step
                latents.append(x.cpu())
    t1, c1 = time.time(), time.thread_time()
    images = policy.decode(x).float().cpu()
    t2, c2 = time.time(), time.thread_time()
    scored = reward_fn is not None
    if not scored:  # a reward worker scores the stored images
        rewards = torch.full((n,), float("nan"))
    else:
        meta = cfg.prompt_metadata(task.prompt)  # GenEval-style datasets: the rewards get it
        rewards = call_reward(reward_fn, images, [task.prompt] * n, None if meta is None else [meta] * n)
        rewards = rewards.float().cpu()
    t3, c3 = time.time(), time.thread_time()
    if timer is not None:
        timer("gen", t0, t1, c1 - c0)
        timer("decode", t1, t2, c2 - c1)
        if scored:
            timer("reward", t2, t3, c3 - c2)
    extra = {"first_step": torch.tensor(first, dtype=torch.int64)} if first else {}
    if plan.means:
        extra["means"] = torch.stack(means, dim=1) if means else torch.empty(n, 0, *x.shape[1:])
    return Trajectories(
        task=task,
        latents=torch.stack(latents, dim=1),
        log_probs=torch.stack(log_probs, dim=1) if log_probs else torch.empty(n, 0),
        sigmas=sigmas,
        images=(images * 255).round().clamp(0, 255).to(torch.uint8),
        rewards=rewards,
        decoded=None if scored else images,
        extra=extra,
    )
