"""The Ulysses test's problem (shared by the d=1 reference and the spawned ranks) and the
rank entry point. Lives outside the test module so spawned processes import only this."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
from safetensors.torch import load_file, save_file

from digen.config import Config, RolloutConfig, TrainConfig
from digen.models.base import FlowPolicy
from digen.rollout import generate_group
from digen.task_records import GroupTask
from digen.training import build_rows, task_gradient

RES = 32
NUM_FRAMES = 5
FAMILIES = ("wan", "hunyuan-video", "flux")
# Video/image tokens per sample (every tiny model has 2 heads): Wan and HunyuanVideo 2 latent
# frames x (4 x 4) latent pixels / patch (1, 2, 2); FLUX (4 x 4) latent pixels / 2 x 2 packing.
TOKENS = {"wan": 8, "hunyuan-video": 8, "flux": 4}
TASK = GroupTask(iteration=0, group=0, prompt="a red square", sample_ids=(0, 1), version=0)
STEPS = [[0, 1, 2], [1, 2]]  # trained steps per sample
ADVANTAGES = torch.tensor([1.0, -0.7])


def make_cfg() -> Config:
    """SDE rollouts with true CFG (text and empty-prompt rows in one batched forward)."""
    return Config(
        model={"path": "tiny (loaded by make_policy)"},
        prompts={"items": ["a red square"]},
        reward=[{"name": "brightness"}],
        rollout=RolloutConfig(batch_size=2, group_size=2, num_steps=3, guidance_scale=2.0),
        train=TrainConfig(clip_range=0.5, rows_per_forward=2, kl_beta=0.1),
    )


def make_policy(model: str) -> FlowPolicy:
    """The tiny model with LoRA whose A and B are seeded random (LoRA's zero B would leave
    every A gradient zero)."""
    from pathlib import Path

    from digen.models import load_policy
    from digen.models.registry import detect_family

    frames = None if detect_family(Path(model)) == "flux" else NUM_FRAMES
    policy = load_policy(model, height=RES, width=RES, num_frames=frames)
    policy.enable_lora(rank=4, alpha=8)
    gen = torch.Generator().manual_seed(1)
    state = policy.trainable_state_dict()
    policy.load_trainable_state_dict(
        {k: 0.1 * torch.randn(v.shape, generator=gen) for k, v in sorted(state.items())}
    )
    return policy


def brightness(frames: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """Mean pixel value per sample: a reward computed from the decoded frames."""
    return frames.flatten(1).mean(1)


def run_problem(policy: FlowPolicy) -> dict[str, torch.Tensor]:
    """One group generated with digen's SDE sampler, then a train step's gradient on it."""
    cfg = make_cfg()
    traj = generate_group(policy, TASK, cfg, brightness)
    embeds = policy.encode_prompts([TASK.prompt], with_uncond=True).repeat_rows(2)
    rows = build_rows(traj.latents, traj.log_probs, traj.sigmas, ADVANTAGES, STEPS)
    grads, _ = task_gradient(policy, rows, embeds, cfg, tsp=True, sigma_max=float(traj.sigmas[1]))
    out = {"latents": traj.latents, "log_probs": traj.log_probs, "rewards": traj.rewards}
    return {**out, **{f"grad/{k}": v for k, v in grads.items()}}


def check_all_to_all(rank: int, world: int, group) -> dict[str, torch.Tensor]:
    """The all-to-all of a [B, S, H, D] shard and back, and its gradient, next to what the
    single-process arithmetic says."""
    from digen.parallel.ulysses import all_to_all, shard_sequence

    gen = torch.Generator().manual_seed(7)
    full = torch.randn(2, 8, 4, 3, generator=gen)
    weight = torch.randn(2, 8, 4, 3, generator=gen)
    x = shard_sequence(full, 1, group).clone().requires_grad_(True)
    y = all_to_all(x, 2, 1, group)  # [B, S, H/d, D]
    heads = slice(rank * 2, rank * 2 + 2)
    back = all_to_all(y, 1, 2, group)
    (y * weight[:, :, heads]).sum().backward()
    return {
        "a2a/err_forward": (y - full[:, :, heads]).abs().max().reshape(1),
        "a2a/err_roundtrip": (back - x).abs().max().reshape(1),
        # the group's loss is sum_r <y_r, w_r>: d/dx of rank r's shard is w's shard
        "a2a/err_grad": (x.grad - weight[:, rank * 4 : rank * 4 + 4]).abs().max().reshape(1),
    }


def first_attention(policy: FlowPolicy):
    """The first block's self-/joint attention module (its output's dim 1 counts the video or
    image tokens this rank attends for)."""
    transformer = policy.transformer
    if policy.family == "wan":
        return transformer.blocks[0].attn1
    return transformer.transformer_blocks[0].attn


def video_tokens(output) -> int:
    """Video/image tokens in an attention module's output (joint attention returns them first,
    then the text tokens)."""
    return (output[0] if isinstance(output, tuple) else output).shape[1]


def run_split_problem(policy: FlowPolicy) -> dict[str, torch.Tensor]:
    """:func:`run_problem` under Ulysses over the default group, with the video/image token
    counts the first attention saw (``sp/tokens_seen``); gradients are this rank's shares."""
    from digen.parallel.ulysses import sequence_parallel

    seen: list[int] = []  # video tokens out of the first attention, per call
    hook = first_attention(policy).register_forward_hook(lambda m, a, o: seen.append(video_tokens(o)))
    with sequence_parallel(policy, None):
        result = run_problem(policy)
    hook.remove()
    return {**result, "sp/tokens_seen": torch.tensor(sorted(set(seen)), dtype=torch.float32)}


def run_rank(rank: int, world: int, rendezvous: str, models: dict[str, str], out_dir: str) -> None:
    """One group member: the all-to-all check, then each family's problem under Ulysses
    (``models``: family -> tiny model folder), one process start for them all."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    import torch.distributed as dist

    from digen.parallel.ulysses import reduce_gradients

    dist.init_process_group(
        "gloo",
        init_method=f"file://{rendezvous}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    try:
        a2a = check_all_to_all(rank, world, None)
        for family, model in models.items():
            result = run_split_problem(make_policy(model))
            grads = reduce_gradients({k: v for k, v in result.items() if k.startswith("grad/")})
            save_file({**result, **grads, **a2a}, rank_file(out_dir, family, rank))
    finally:
        dist.destroy_process_group()


def rank_file(out_dir: str, family: str, rank: int) -> str:
    return os.path.join(out_dir, f"{family}-rank{rank}.safetensors")


def load_rank(out_dir: str, family: str, rank: int) -> dict[str, torch.Tensor]:
    return load_file(rank_file(out_dir, family, rank))
