"""The evaluator: one chunk of held-out prompts (:class:`~digen.evaluation.EvalTask`) sampled
with the deterministic Euler ODE sampler from each prompt's own noise stream, decoded and
scored by every reward (:mod:`digen.evaluation` describes the evaluation; it plans the
chunks and books their results without torch, for the controller). A rollout worker runs
:func:`evaluate_chunk` for an ``eval`` task; the reference loop :func:`evaluate_inline`.
"""

from __future__ import annotations

import time

import torch

from digen.algos.sde import euler_step
from digen.algos.state import loaded_ema, swapped_weights
from digen.config import Config
from digen.evaluation import (
    TOTAL,
    EvalBook,
    EvalResult,
    EvalTask,
    eval_version,
    evaluates_ema,
    plan_eval,
    write_evaluation,
)
from digen.models.base import FlowPolicy, PromptEmbeds
from digen.prompt_cache import EmbedCache
from digen.rewards.base import call_reward
from digen.rundir import RunDir
from digen.seeding import generator
from digen.viz import image_cells


def score_components(
    reward, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None
) -> dict[str, torch.Tensor]:
    """``{"reward": weighted sum [B], <name>: that reward's own scores [B], ...}``.
    metadata: per-prompt metadata (GenEval-style test sets), or None."""
    if callable(getattr(reward, "score_parts", None)):
        total, parts = reward.score_parts(images, prompts, metadata)
    else:
        total = call_reward(reward, images, prompts, metadata).detach().float().cpu()
        parts = {reward.name or "reward": total}
    return {TOTAL: total.float().cpu(), **{k: v.float().cpu() for k, v in parts.items() if k != TOTAL}}


def evaluate_chunk(
    policy: FlowPolicy, task: EvalTask, cfg: Config, reward, embed: EmbedCache | None = None
) -> EvalResult:
    """:func:`sample_chunk` with the loaded weights, or with ``train.ema.eval`` with the EMA
    the loaded version carries (:func:`~digen.algos.state.loaded_ema`), swapped in for the
    chunk and back (as Flow-GRPO's ``eval``: ``copy_ema_to(store_temp=True)``, then
    ``copy_temp_to``)."""
    if not evaluates_ema(cfg):
        return sample_chunk(policy, task, cfg, reward, embed)
    ema = loaded_ema(policy)
    if not ema:
        raise RuntimeError(  # an evaluated version is always loaded with it
            f"train.ema.eval: version {task.version} was loaded without its EMA (ema/<name> tensors); "
            f"an evaluated version carries it (digen.evaluation.carries_ema)"
        )
    with swapped_weights(policy, ema):
        return sample_chunk(policy, task, cfg, reward, embed)


@torch.no_grad()
def sample_chunk(
    policy: FlowPolicy, task: EvalTask, cfg: Config, reward, embed: EmbedCache | None = None
) -> EvalResult:
    """ODE-sample the chunk's prompts with the policy's weights, decode, score.

    latents ``[B, *latent]``; sigmas ``[eval_steps + 1]``; one Euler step per sigma pair.
    Each prompt's embeddings come from ``embed``, the worker's cache that generation and
    training share (None: a cache of this chunk alone): each prompt encoded on its own, the
    rows stacked (:meth:`PromptEmbeds.cat`), in every mode alike.
    """
    r = cfg.rollout
    prompts = list(task.prompts)
    embed = embed if embed is not None else EmbedCache.for_config(policy, cfg)
    embeds = PromptEmbeds.cat(embed.many(prompts))
    x = torch.stack([policy.initial_noise(generator("eval", cfg.eval.seed, i)) for i in task.indices])
    sigmas = policy.sigmas(r.eval_steps).float().cpu()
    n = x.shape[0]
    for i in range(r.eval_steps):
        s, s_next = float(sigmas[i]), float(sigmas[i + 1])
        v = policy.velocity(x, torch.full((n,), s, device=x.device), embeds, r.guidance_scale)
        x = euler_step(v, x, s, s_next)
    images = policy.decode(x).float().cpu()
    metadata = [cfg.prompt_metadata(p) for p in prompts]
    scores = score_components(reward, images, prompts, None if None in metadata else metadata)
    cells = image_cells((images * 255).round().clamp(0, 255).to(torch.uint8))
    return EvalResult(task, cells, {k: [float(x) for x in v] for k, v in scores.items()})


def evaluate_inline(
    policy: FlowPolicy,
    cfg: Config,
    reward,
    run: RunDir,
    prompts: list[str],
    iteration: int,
    embed: EmbedCache | None = None,
) -> dict:
    """The reference trainer's evaluation: every chunk in turn, with the policy's current
    weights (:func:`~digen.evaluation.eval_version`) and the loop's prompt cache ``embed``;
    returns the row written."""
    tasks = plan_eval(cfg, prompts, iteration)
    book = EvalBook(iteration, eval_version(cfg, iteration), len(tasks))
    for task in tasks:
        t0 = time.time()
        book.add(evaluate_chunk(policy, task, cfg, reward, embed), time.time() - t0)
    return write_evaluation(run, book)
