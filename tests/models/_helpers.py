"""Shared helpers for the model tests."""

from __future__ import annotations

import torch

from digen.models import FlowPolicy, PromptEmbeds

RES = 32  # tiny models' pixel size: 4x4 latents (SD3), 4 packed tokens (FLUX)


def noise(policy: FlowPolicy, batch: int, seed: int = 0) -> torch.Tensor:
    """``[batch, *latent_shape]`` float32 starting noise."""
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([policy.initial_noise(gen) for _ in range(batch)])


def euler_sample(
    policy: FlowPolicy, latents: torch.Tensor, embeds: PromptEmbeds, guidance_scale: float, steps: int
) -> torch.Tensor:
    """Plain Euler ODE with the policy (what the pipelines' scheduler.step does)."""
    sigmas = policy.sigmas(steps)
    x = latents.clone()
    with torch.no_grad():
        for i in range(steps):
            v = policy.velocity(x, sigmas[i].expand(x.shape[0]), embeds, guidance_scale)
            x = x + (sigmas[i + 1] - sigmas[i]) * v
    return x
