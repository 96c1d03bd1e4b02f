"""Generation: prompt groups -> trajectories with behaviour log-probs, images, rewards.

A generation task is one *group* (``group_size`` samples of one prompt). The reference loop
generates each group as one batch of its own; a worker may run up to ``rollout.max_batch``
groups of one iteration as one batch (:func:`generate_groups`: one forward per denoising
step for all their samples, both CFG branches in it), each still its own task. A sample's
noise comes from its own stream (:mod:`digen.seeding`), so a group can run on any worker, in
any batch: at ``max_batch`` 1 the distributed modes reproduce the reference trainer's samples
bit for bit; in a larger batch a sample equals its unbatched self bit for bit where the
kernels do not depend on the batch's size, else to float32 round-off (CPU sgemm picks its
kernel by the matrix shape; tests/trainer/test_batched_generation.py states the bounds).
Which groups an iteration samples is planned without torch (:func:`digen.task_records.plan_groups`).
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
from digen.rewards.registry import score_each
from digen.seeding import sample_generator
from digen.task_records import GroupTask


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
    reward_parts: see the field
    """

    task: GroupTask
    latents: torch.Tensor
    log_probs: torch.Tensor
    sigmas: torch.Tensor
    images: torch.Tensor
    rewards: torch.Tensor
    decoded: torch.Tensor | None = None
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    reward_parts: torch.Tensor | None = None
    """``[B, K]`` float32, each sample's score of each of the config's K rewards (unweighted),
    kept only with ``train.multi_reward`` ``per_reward`` or ``gdpo`` (the book's advantages); not
    in :meth:`tensors` (a train task needs only the advantages)."""

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
    for all, every stream still drawn once so their positions stay aligned), drawn on the host
    and moved to the device in one copy that the host does not wait for."""
    if shared:
        first = policy.host_noise(gens[0])
        x = first.unsqueeze(0).repeat(len(gens), *([1] * first.dim()))
        for g in gens[1:]:  # keep every stream at the same position
            policy.host_noise(g)
    else:
        x = torch.stack([policy.host_noise(g) for g in gens])
    return _to_device(x, policy.device)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host, without waiting for the device: a host tensor as it is (the sampling
    loop never writes one in place); a device tensor's copy queued on the device's stream into
    a host buffer of its own (pinned for CUDA, so the copy is truly asynchronous). Its values
    are final after :func:`_settle`, not before."""
    if t.device.type == "cpu":
        return t
    buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.device.type == "cuda")
    return buf.copy_(t, non_blocking=True)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor ``t`` (noise drawn on CPU generators) on ``device``, without waiting for
    the device: to CUDA from pinned memory, asynchronously (torch keeps the pinned buffer until
    the copy is done); on the host, ``t`` itself."""
    device = torch.device(device)
    if device.type == "cpu":
        return t
    src = t.pin_memory() if device.type == "cuda" else t
    return src.to(device, non_blocking=True)


def _settle(device: torch.device) -> None:
    """Wait once for every copy :func:`_to_host` queued on ``device``'s current stream."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


Timer = Callable[[str, float, float, float], None]
"""Called as ``timer(kind, start, end, cpu_s)`` for each phase (``gen``, ``decode``,
``reward``): wall-clock start and end, and the CPU seconds the calling thread spent in it
(:func:`time.thread_time`), which waiting for a core does not inflate (``digen bench``'s
bound on a machine with more busy workers than cores, :mod:`digen.bench.summary`)."""


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
    embeds_list = None if embeds is None else [embeds]
    timers = None if timer is None else [timer]
    return generate_groups(policy, [task], cfg, reward_fn, embeds_list, timers, stop)[0]


def batch_key(embeds: PromptEmbeds) -> tuple:
    """What groups must agree on to run as one batch: the shapes and dtypes of their prompt
    embeddings (a family whose prompt length is its prompt's own, Qwen-Image, pads the rows
    of one batch to the longest, which would change a shorter prompt's bits)."""
    return tuple(
        (part, k, tuple(v.shape[1:]), v.dtype)
        for part, d in (("c", embeds.tensors), ("u", embeds.uncond))
        for k, v in sorted(d.items())
    )


@torch.no_grad()
def generate_groups(
    policy: FlowPolicy,
    tasks: list[GroupTask],
    cfg: Config,
    reward_fn: Callable[..., torch.Tensor] | None,
    embeds: list[PromptEmbeds] | None = None,
    timers: list[Timer] | None = None,
    stop: Callable[[], bool] | None = None,
) -> list[Trajectories]:
    """Sample several groups of one iteration as one batch (``rollout.max_batch``): their
    samples stacked in task order, one transformer forward per denoising step for all of them
    (both CFG branches in it), each sample's noise drawn from its own stream as when its group
    runs alone. Each group is then decoded and scored on its own (its images and rewards are
    the bits of its unbatched self). ``embeds``: each group's prompt embeddings (None: encoded
    here), all of one :func:`batch_key`. ``timers``: one per group; the batch's ``gen`` time
    is split evenly among its groups, in task order, so the timeline's busy time is the
    worker's. See :func:`generate_group` for the rest."""
    if not tasks:
        return []
    if len({t.iteration for t in tasks}) > 1:
        raise ValueError(
            f"one batch generates one iteration's groups, not {sorted({t.iteration for t in tasks})}"
        )
    r = cfg.rollout
    algo = algorithm_for(cfg)
    iteration = tasks[0].iteration
    plan = algo.rollout_plan(cfg, iteration)
    t0, c0 = time.time(), time.thread_time()
    sizes = [len(t.sample_ids) for t in tasks]
    n = sum(sizes)
    cfg_on = r.guidance_scale > 1.0
    if embeds is None:
        embeds = [policy.encode_prompts([t.prompt], with_uncond=cfg_on) for t in tasks]
    if len({batch_key(e) for e in embeds}) > 1:
        raise ValueError("the groups of one batch must have prompt embeddings of one shape (batch_key)")
    rows = [e.repeat_rows(k) for e, k in zip(embeds, sizes, strict=True)]
    batch_embeds = rows[0] if len(rows) == 1 else PromptEmbeds.cat(rows)
    sigmas = policy.sigmas(r.num_steps).float().cpu()
    sigma_max = float(sigmas[1])
    path = sigmas if plan.schedule is None else sigmas[list(plan.schedule)]
    first, count = plan.keep

    task_gens = [[sample_generator(cfg.seed, t.iteration, s, "noise") for s in t.sample_ids] for t in tasks]
    gens = [g for tg in task_gens for g in tg]
    with algo.sampling(policy):
        noise = [_initial_noise(policy, tg, r.shared_noise) for tg in task_gens]
        x = noise[0] if len(noise) == 1 else torch.cat(noise)
        # what the trajectory stores is copied to the host as it is made, never waited for inside
        # the loop (one wait after it): the host queues step i + 1 while the device runs step i
        latents = [_to_host(x)] if first == 0 else []
        log_probs, means = [], []
        history = "dpm2" in plan.kinds  # DPM-Solver++(2M) needs the previous step's x0 prediction
        prev_x0: torch.Tensor | None = None
        for i, kind in enumerate(plan.kinds):
            if stop is not None and stop():
                groups = ", ".join(str(t.group) for t in tasks)
                raise TaskDropped(
                    f"group(s) {groups} of iteration {iteration} dropped at step {i}: the job stopped"
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
                    noise=_to_device(eps, x.device),
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
                latents.append(_to_host(x))
                log_probs.append(_to_host(lp.float()))
                if plan.means:
                    means.append(
                        _to_host((mean if mean is not None else torch.full_like(x, float("nan"))).float())
                    )
            elif i + 1 == first:  # the stored range starts after this step
                latents.append(_to_host(x))
        _settle(x.device)
    t1, c1 = time.time(), time.thread_time()
    if timers is not None:  # the batch's sampling time, an equal share for each group
        share, cpu = (t1 - t0) / len(tasks), (c1 - c0) / len(tasks)
        for j, timer in enumerate(timers):
            timer("gen", t0 + j * share, t0 + (j + 1) * share, cpu)
    lat = torch.stack(latents, dim=1).split(sizes)
    lps = (torch.stack(log_probs, dim=1) if log_probs else torch.empty(n, 0)).split(sizes)
    mns = (torch.stack(means, dim=1) if means else torch.empty(n, 0, *x.shape[1:])).split(sizes)
    out = []
    for j, (task, x_j) in enumerate(zip(tasks, x.split(sizes), strict=True)):
        timer = None if timers is None else timers[j]
        extra = {"first_step": torch.tensor(first, dtype=torch.int64)} if first else {}
        if plan.means:
            extra["means"] = mns[j].contiguous()
        images, rewards, parts, decoded = _decode_and_score(policy, task, cfg, reward_fn, x_j, timer)
        out.append(
            Trajectories(
                task=task,
                latents=lat[j].contiguous(),
                log_probs=lps[j].contiguous(),
                sigmas=sigmas,
                images=images,
                rewards=rewards,
                decoded=decoded,
                extra=extra,
                reward_parts=parts,
            )
        )
    return out


def _decode_and_score(
    policy: FlowPolicy,
    task: GroupTask,
    cfg: Config,
    reward_fn: Callable[..., torch.Tensor] | None,
    x: torch.Tensor,
    timer: Timer | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One group's final latents ``x [n, *latent]`` decoded and scored (``reward_fn`` None:
    rewards NaN until a ``reward`` task scores the returned float images): ``(images uint8,
    rewards [n], per-reward scores [n, K] (``train.multi_reward`` other than ``sum``) or None, decoded
    or None)``."""
    n = x.shape[0]
    t1, c1 = time.time(), time.thread_time()
    images = policy.decode(x).float().cpu()
    t2, c2 = time.time(), time.thread_time()
    scored = reward_fn is not None
    parts = None
    if not scored:  # a reward worker scores the stored images
        rewards = torch.full((n,), float("nan"))
    else:
        rewards, parts = score_group(reward_fn, images, task.prompt, cfg)
    t3, c3 = time.time(), time.thread_time()
    if timer is not None:
        timer("decode", t1, t2, c2 - c1)
        if scored:
            timer("reward", t2, t3, c3 - c2)
    uint8 = (images * 255).round().clamp(0, 255).to(torch.uint8)
    return uint8, rewards, parts, None if scored else images


def score_group(
    reward_fn: Callable[..., torch.Tensor], images: torch.Tensor, prompt: str, cfg: Config
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A group's decoded ``images`` (float, ``[n, ...]``) scored against its ``prompt`` (and its
    metadata, for GenEval-style datasets): ``(rewards [n], per-reward scores [n, K] or None)``,
    float32 on the CPU; the per-reward scores only with ``train.multi_reward`` ``per_reward`` or
    ``gdpo``.
    What a generation task scoring inline and a ``reward`` task both run."""
    n = images.shape[0]
    meta = cfg.prompt_metadata(prompt)
    metadata = None if meta is None else [meta] * n
    if cfg.train.multi_reward != "sum":
        rewards, parts = score_each(reward_fn, images, [prompt] * n, metadata)
        return rewards.float().cpu(), parts.float().cpu()
    return call_reward(reward_fn, images, [prompt] * n, metadata).float().cpu(), None
