"""Advantages and trained-timestep selection equal the peers' own formulas, restated here.

Flow-GRPO: yifan123/flow_grpo flow_grpo/stat_tracking.py ``PerPromptStatTracker.update``
(``(r - mean_prompt) / (np.std + 1e-4)``, population std of the prompt's rewards or of all
rewards with ``global_std``), clamped to ``+-adv_clip_max`` in scripts/train_sd3.py's loss;
``num_train_timesteps = int(num_steps * timestep_fraction)`` in scripts/train_sd3.py ``main``.
DanceGRPO: XueZeyue/DanceGRPO fastvideo/train_grpo_flux.py ``train_one_step``
(``(r - mean) / (torch.std + 1e-8)`` per group of ``num_generations``, clamped in the loss;
the last timestep dropped, a per-sample ``randperm`` of the rest, the first
``int(len * timestep_fraction)`` trained).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from digen.algos import group_advantages, select_timesteps

REWARDS = [0.31, 0.92, 0.47, 0.05, 1.7, -0.4, 2.2, 0.9, 0.5, 0.5, 0.5, 0.5]
GROUPS = [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]  # group 2 is flat: no signal


def flow_grpo_advantages(rewards, groups, global_std: bool, clip: float = 5.0) -> np.ndarray:
    r, g = np.asarray(rewards, dtype=np.float64), np.asarray(groups)
    out = np.zeros_like(r)
    for k in np.unique(g):
        own = r[g == k]
        std = (np.std(r) if global_std else np.std(own)) + 1e-4
        out[g == k] = (own - np.mean(own)) / std
    return np.clip(out, -clip, clip)


def dance_grpo_advantages(rewards, group_size: int, clip: float = 5.0) -> torch.Tensor:
    r = torch.tensor(rewards, dtype=torch.float32)
    out = torch.zeros_like(r)
    for i in range(len(r) // group_size):
        own = r[i * group_size : (i + 1) * group_size]
        out[i * group_size : (i + 1) * group_size] = (own - own.mean()) / (own.std() + 1e-8)
    return out.clamp(-clip, clip)


@pytest.mark.parametrize("global_std", [False, True])
def test_advantages_equal_flow_grpo(global_std: bool) -> None:
    ours = group_advantages(REWARDS, GROUPS, global_std=global_std, eps=1e-4, clip=5.0).values
    theirs = torch.from_numpy(flow_grpo_advantages(REWARDS, GROUPS, global_std)).float()
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    assert ours[8:].abs().max() == 0  # the flat group: exactly no signal in both


def test_advantages_equal_dance_grpo() -> None:
    ours = group_advantages(REWARDS[:8], GROUPS[:8], unbiased=True, eps=1e-8, clip=5.0).values
    torch.testing.assert_close(ours, dance_grpo_advantages(REWARDS[:8], 4), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("num_steps", [4, 10, 16, 20, 100])
@pytest.mark.parametrize("fraction", [0.29, 0.4, 0.5, 0.6, 0.99, 1.0])
def test_prefix_is_flow_grpos_count(num_steps: int, fraction: float) -> None:
    expected = list(range(max(1, int(num_steps * fraction))))
    assert select_timesteps(num_steps, strategy="prefix", fraction=fraction) == expected


@pytest.mark.parametrize("num_steps, fraction", [(16, 0.6), (10, 0.6), (20, 0.4), (8, 0.5), (4, 1.0)])
def test_random_is_dance_grpos_subset(num_steps: int, fraction: float) -> None:
    for seed in range(5):
        perm = torch.randperm(num_steps - 1, generator=torch.Generator().manual_seed(seed))
        theirs = sorted(perm[: int((num_steps - 1) * fraction)].tolist())
        gen = torch.Generator().manual_seed(seed)
        assert select_timesteps(num_steps, strategy="random", fraction=fraction, generator=gen) == theirs


def flow_grpo_window(num_steps: int, window: int, window_range: tuple[int, int], rng) -> tuple[int, int]:
    """flow_grpo/diffusers_patch/sd3_pipeline_with_logprob_fast.py (9745241), restated: the
    SDE window of one sampling call."""
    start = rng.randint(window_range[0], window_range[1] - window)
    return (start, start + window)


# Qwen-Image-Edit's windowed recipe is refused (not a digen family)
WINDOWED = ["geneval_sd3_fast_nocfg", "pickscore_sd3_fast_nocfg", "geneval_flux_fast", "pickscore_flux_fast",
            "pickscore_qwenimage", "pickscore_qwenimage_8gpu"]  # fmt: skip


@pytest.mark.parametrize("recipe", WINDOWED)
def test_the_window_of_each_windowed_flow_grpo_recipe_covers_the_peers_windows(recipe: str) -> None:
    """Imported with its sde_window_range, a recipe draws its windows (the start uniform over
    the same integers) where Flow-GRPO's draw puts them; never outside (digen used to place the
    window over the whole trajectory: starts 0-8 of 10 steps)."""
    import random
    from pathlib import Path

    from digen.algos.flow_grpo import window_steps
    from digen.config import build_config
    from digen.importers import import_config
    from digen.importers.pyconfig import ConfigModule, flatten

    grpo = Path(__file__).resolve().parents[1] / "data" / "peers" / "flow_grpo" / "config" / "grpo.py"
    cfg = build_config(import_config("flow-grpo", f"{grpo}:{recipe}").config, check_paths=False)
    ts, n = cfg.train.timesteps, cfg.rollout.num_steps
    recipe_range = flatten(ConfigModule(grpo, base=ConfigModule(grpo.parent / "base.py")).call(recipe))[
        "sample.sde_window_range"
    ]  # the recipe's own (0, config.sample.num_steps // 2)
    rng = random.Random(0)
    theirs = {flow_grpo_window(n, ts.window, tuple(recipe_range), rng) for _ in range(400)}
    ours = set()
    for iteration in range(400):
        steps = window_steps(cfg, iteration)
        assert steps is not None and steps == list(range(steps[0], steps[0] + ts.window))
        ours.add((steps[0], steps[-1] + 1))
    assert ours == theirs
    counts = [sum(window_steps(cfg, i)[0] == s for i in range(400)) for s, _ in sorted(theirs)]
    # uniform over the starts: each within 40% of its share (400 draws over at most 4 starts)
    assert min(counts) > 0.6 * 400 / len(theirs)


def dance_grpo_per_reward_advantages(
    vq, mq, group_size: int, vq_coef: float, mq_coef: float, clip: float = 5.0
):
    """XueZeyue/DanceGRPO 15cc71d fastvideo/train_grpo_hunyuan.py l.370-392 and the clamps of
    l.449-468, restated: one advantage per reward, (r - mean) / (torch.std + 1e-8) per group,
    each clamped, weighted by its coefficient (the losses they enter are summed likewise)."""
    vq, mq = torch.tensor(vq, dtype=torch.float32), torch.tensor(mq, dtype=torch.float32)
    vq_adv, mq_adv = torch.zeros_like(vq), torch.zeros_like(mq)
    for i in range(len(vq) // group_size):
        s, e = i * group_size, (i + 1) * group_size
        vq_adv[s:e] = (vq[s:e] - vq[s:e].mean()) / (vq[s:e].std() + 1e-8)
        mq_adv[s:e] = (mq[s:e] - mq[s:e].mean()) / (mq[s:e].std() + 1e-8)
    return vq_coef * torch.clamp(vq_adv, -clip, clip) + mq_coef * torch.clamp(mq_adv, -clip, clip)


@pytest.mark.parametrize("coefs", [(1.0, 0.0), (1.0, 1.0), (0.7, 0.3)])
def test_per_reward_advantages_equal_dance_grpo(coefs) -> None:
    from digen.algos import per_reward_advantages

    vq = REWARDS[:8]
    mq = [5.0, 5.1, 4.9, 5.0, 90.0, 10.0, 50.0, 70.0]  # another scale: the per-reward sum keeps both
    ours = per_reward_advantages(
        torch.tensor([vq, mq]).T, GROUPS[:8], coefs, unbiased=True, eps=1e-8, clip=5.0
    ).values
    theirs = dance_grpo_per_reward_advantages(vq, mq, 4, *coefs)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    summed = group_advantages(
        [coefs[0] * a + coefs[1] * b for a, b in zip(vq, mq, strict=True)],
        GROUPS[:8],
        unbiased=True,
        eps=1e-8,
    ).values
    if coefs[1]:  # the weighted reward sum is another advantage (the large-scale reward dominates)
        assert (summed - theirs).abs().max() > 0.1
    flat = per_reward_advantages(
        torch.tensor([[1.0, 2.0]] * 4 + [[1.0, 2.0], [3.0, 2.0]] * 2), GROUPS[:8], coefs
    )
    assert flat.zero_std_groups == 1 and flat.values[:4].abs().max() == 0
