"""Batched generation (``rollout.max_batch``): groups run as one forward per denoising step,
each sample's noise and trajectory its unbatched self's.

Bit for bit where the CPU kernels do not depend on the batch (the tiny Wan model); otherwise
within float32 round-off: MKL chooses its sgemm kernel by the matrix shape, so a layer can
give a row other bits at 12 rows than at 4 (measured on the tiny SD3 model: its timestep
embedder's Linear(256 -> 32)). The bounds below are ~10x the differences measured on the
tiny SD3, FLUX and HunyuanVideo models (latents 2.6e-6, log-probs 2.4e-7, rewards 6e-8, an
image one uint8 level), far inside the PPO clip range (1e-4)."""

from __future__ import annotations

import pytest
import torch

from digen.assembly import build_policy, build_reward
from digen.config import build_config
from digen.iteration import IterationBook
from digen.prompt_cache import EmbedCache
from digen.rollout import generate_group, generate_groups
from digen.task_records import plan_groups
from digen.training import train_group
from tests.conftest import small_config_data

TOLERANCE = {"latents": 2e-5, "log_probs": 2e-6, "rewards": 1e-6, "images": 1, "sigmas": 0}


def three_groups(model_dir, **sections):
    data = small_config_data(
        model_dir,
        rollout__batch_size=12,
        rollout__guidance_scale=4.5,  # both CFG branches in the batch's forward
        **sections,
    )
    cfg = build_config(data)
    policy, reward = build_policy(cfg), build_reward(cfg)
    embed = EmbedCache.for_config(policy, cfg)
    tasks = plan_groups(cfg, cfg.prompt_list(), 0, 0)
    assert len({t.prompt for t in tasks}) == 3
    alone = [generate_group(policy, t, cfg, reward, embeds=embed(t.prompt)) for t in tasks]
    batched = generate_groups(policy, tasks, cfg, reward, embed.many([t.prompt for t in tasks]))
    return cfg, policy, embed, alone, batched


@pytest.mark.slow
def test_a_batch_generates_each_groups_samples_bit_for_bit_where_the_kernels_allow(tiny_models):
    *_, alone, batched = three_groups(tiny_models("wan"), model__num_frames=5)
    for a, b in zip(alone, batched, strict=True):
        assert b.task == a.task
        for name, t in a.tensors().items():
            assert torch.equal(b.tensors()[name], t), name


@pytest.mark.parametrize("arch", ["sd3", pytest.param("flux", marks=pytest.mark.slow)])
def test_a_batch_generates_each_groups_samples_within_round_off_and_trains_at_ratio_one(tiny_models, arch):
    cfg, policy, embed, alone, batched = three_groups(tiny_models(arch))
    for a, b in zip(alone, batched, strict=True):
        got = b.tensors()
        assert torch.equal(got["latents"][:, 0], a.latents[:, 0])  # the noise: each sample's own stream
        for name, t in a.tensors().items():
            diff = (got[name].double() - t.double()).abs().max().item()
            assert diff <= TOLERANCE[name], (name, diff)
    # the behaviour log-probs of a batched group: its own group's training forward gives the
    # ratio 1 within the round-off above (exactly 1 unbatched)
    task = alone[0].task
    book = IterationBook(cfg, 0, [task])
    book.add_rewards(0, alone[0].rewards.tolist())
    spec = book.train_spec(0)
    devs = [
        train_group(policy, spec, t.tensors(), embed(task.prompt), cfg, tsp=False)[1].ratio_max_dev
        for t in (alone[0], batched[0])
    ]
    assert devs[0] == 0.0 and devs[1] < 1e-5, devs


def test_groups_whose_embeddings_differ_in_shape_are_not_one_batch(small_config):
    cfg = small_config()
    policy = build_policy(cfg)
    tasks = plan_groups(cfg, cfg.prompt_list(), 0, 0)
    embeds = [policy.encode_prompts([t.prompt], with_uncond=False) for t in tasks]
    short = type(embeds[1])({k: v[:, :-1] for k, v in embeds[1].tensors.items()})  # a shorter prompt
    with pytest.raises(ValueError, match="one shape"):
        generate_groups(policy, tasks, cfg, None, [embeds[0], short])
