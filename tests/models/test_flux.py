"""FluxPolicy: packed latents, dynamic-shift sigmas, embedded guidance, checked against FluxPipeline."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from digen.errors import ConfigError
from digen.models import load_policy

from ._helpers import RES, euler_sample, noise

PROMPTS = ["a photo of a cat", "a red car"]


def test_packed_latent_shape_and_image_ids(flux_policy):
    seq = (RES // 16) ** 2
    assert flux_policy.latent_shape() == (seq, 64)
    assert flux_policy.latent_image_ids.shape == (seq, 3)
    assert flux_policy.latent_image_ids[:, 1:].max() == RES // 16 - 1


def test_sigmas_use_resolution_shift(flux_policy, tiny_paths):
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    sigmas = flux_policy.sigmas(3)
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(tiny_paths["flux"], subfolder="scheduler")
    scheduler.set_timesteps(3, sigmas=np.linspace(1.0, 1 / 3, 3), mu=calculate_shift(4, 256, 4096, 0.5, 1.15))
    assert sigmas.shape == (4,) and sigmas.dtype == torch.float32
    torch.testing.assert_close(sigmas, scheduler.sigmas)
    assert sigmas[0] == 1.0 and sigmas[-1] == 0.0 and (sigmas.diff() < 0).all()
    # exponential time shift: e^mu / (e^mu + 1/s - 1), mu from 4 image tokens
    mu = 0.5 + (4 - 256) * (1.15 - 0.5) / (4096 - 256)
    assert sigmas[1].item() == pytest.approx(np.exp(mu) / (np.exp(mu) + 1.5 - 1), abs=1e-5)


def test_embeds_have_no_uncond_effect_with_embedded_guidance(flux_policy):
    with_uncond = flux_policy.encode_prompts(PROMPTS, with_uncond=True)
    plain = flux_policy.encode_prompts(PROMPTS, with_uncond=False)
    assert with_uncond.tensors["encoder_hidden_states"].shape == (2, flux_policy.max_sequence_length, 64)
    assert with_uncond.tensors["pooled_projections"].shape == (2, 32)
    x, sigmas = noise(flux_policy, 2), torch.tensor([0.8, 0.8])
    torch.testing.assert_close(
        flux_policy.velocity(x, sigmas, with_uncond, 3.5), flux_policy.velocity(x, sigmas, plain, 3.5)
    )


def test_guidance_scale_feeds_the_guidance_embedding(flux_policy):
    embeds = flux_policy.encode_prompts(PROMPTS, with_uncond=False)
    x, sigmas = noise(flux_policy, 2), torch.tensor([0.8, 0.8])
    low, high = flux_policy.velocity(x, sigmas, embeds, 1.0), flux_policy.velocity(x, sigmas, embeds, 5.0)
    assert (low - high).abs().max() > 1e-4


def test_velocity_shape_dtype_and_per_row_sigmas(flux_policy):
    embeds = flux_policy.encode_prompts(PROMPTS, with_uncond=False)
    x = noise(flux_policy, 2)
    sigmas = torch.tensor([0.95, 0.2])
    v = flux_policy.velocity(x, sigmas, embeds, 3.5)
    assert v.shape == x.shape and v.dtype == torch.float32
    for row in range(2):
        alone = flux_policy.velocity(x[row : row + 1], sigmas[row : row + 1], embeds.index([row]), 3.5)
        torch.testing.assert_close(v[row : row + 1], alone, atol=1e-5, rtol=0)
    assert not torch.allclose(flux_policy.velocity(x, sigmas.flip(0), embeds, 3.5), v, atol=1e-4)


def test_euler_sampling_matches_the_pipeline(flux_policy):
    """Same packed noise, 2 steps, guidance 3.5: policy ODE then decode == FluxPipeline."""
    x0 = noise(flux_policy, 1, seed=5)
    embeds = flux_policy.encode_prompts(PROMPTS[:1], with_uncond=False)
    ours = flux_policy.decode(euler_sample(flux_policy, x0, embeds, 3.5, steps=2))
    ref = flux_policy.pipe(
        PROMPTS[0],
        num_inference_steps=2,
        height=RES,
        width=RES,
        guidance_scale=3.5,
        latents=x0,
        max_sequence_length=flux_policy.max_sequence_length,
        output_type="pt",
    ).images
    assert ours.shape == (1, 3, RES, RES) and 0.0 <= ours.min() and ours.max() <= 1.0
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)


def test_size_must_fit_the_packing(tiny_paths):
    with pytest.raises(ConfigError, match="width \\(24\\) must be a positive multiple of 16 for flux"):
        load_policy(tiny_paths["flux"], height=RES, width=24)
