"""Sd3Policy: the StableDiffusion3Pipeline conventions, checked against the pipeline itself."""

from __future__ import annotations

import pytest
import torch

from digen.errors import ConfigError
from digen.models import load_policy

from ._helpers import RES, euler_sample, noise

PROMPTS = ["a photo of a cat", "a red car"]


def test_latent_shape_and_noise(sd3_policy):
    assert sd3_policy.latent_shape() == (16, RES // 8, RES // 8)
    a = sd3_policy.initial_noise(torch.Generator().manual_seed(3))
    b = sd3_policy.initial_noise(torch.Generator().manual_seed(3))
    assert a.shape == (16, 4, 4) and a.dtype == torch.float32 and torch.equal(a, b)


def test_sigmas_are_the_schedulers(sd3_policy, tiny_paths):
    from diffusers import FlowMatchEulerDiscreteScheduler

    sigmas = sd3_policy.sigmas(4)
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(tiny_paths["sd3"], subfolder="scheduler")
    scheduler.set_timesteps(4)
    assert sigmas.shape == (5,) and sigmas.dtype == torch.float32
    assert torch.equal(sigmas, scheduler.sigmas)
    assert sigmas[0] == 1.0 and sigmas[-1] == 0.0 and (sigmas.diff() < 0).all()

    # shift 3: sigma' = 3s / (1 + 2s), s on linspace(1, s_min, 4), s_min = the shifted 1/1000
    def shift(s: float) -> float:
        return 3 * s / (1 + 2 * s)

    s = 1 - 2 * (1 - shift(0.001)) / 3
    assert sigmas[2].item() == pytest.approx(shift(s), abs=1e-5)


def test_encode_prompts_keys_and_shapes(sd3_policy):
    embeds = sd3_policy.encode_prompts(PROMPTS, with_uncond=True)
    ehs, pooled = embeds.tensors["encoder_hidden_states"], embeds.tensors["pooled_projections"]
    assert ehs.shape == (2, 77 + sd3_policy.max_sequence_length, 64) and pooled.shape == (2, 64)
    assert set(embeds.uncond) == set(embeds.tensors)
    assert torch.equal(embeds.uncond["pooled_projections"][0], embeds.uncond["pooled_projections"][1])
    assert not torch.equal(pooled[0], pooled[1])
    assert sd3_policy.encode_prompts(PROMPTS, with_uncond=False).uncond == {}


def test_velocity_shape_dtype_and_per_row_sigmas(sd3_policy):
    embeds = sd3_policy.encode_prompts(PROMPTS, with_uncond=True)
    x = noise(sd3_policy, 2)
    sigmas = torch.tensor([0.9, 0.3])
    v = sd3_policy.velocity(x, sigmas, embeds, 4.5)
    assert v.shape == x.shape and v.dtype == torch.float32
    for row in range(2):
        alone = sd3_policy.velocity(x[row : row + 1], sigmas[row : row + 1], embeds.index([row]), 4.5)
        torch.testing.assert_close(v[row : row + 1], alone, atol=1e-5, rtol=0)
    swapped = sd3_policy.velocity(x, sigmas.flip(0), embeds, 4.5)
    assert not torch.allclose(swapped, v, atol=1e-4)


def test_cfg_changes_output_and_scale_one_means_no_cfg(sd3_policy):
    with_uncond = sd3_policy.encode_prompts(PROMPTS, with_uncond=True)
    cond_only = sd3_policy.encode_prompts(PROMPTS, with_uncond=False)
    x, sigmas = noise(sd3_policy, 2), torch.tensor([0.7, 0.7])
    v_cfg = sd3_policy.velocity(x, sigmas, with_uncond, 4.5)
    v_plain = sd3_policy.velocity(x, sigmas, cond_only, 4.5)
    assert (v_cfg - v_plain).abs().max() > 1e-3
    torch.testing.assert_close(sd3_policy.velocity(x, sigmas, with_uncond, 1.0), v_plain, atol=1e-5, rtol=0)
    # uncond + s * (cond - uncond), computed by hand from two uncond/cond passes
    uncond_as_cond = type(with_uncond)(with_uncond.uncond)
    v_uncond = sd3_policy.velocity(x, sigmas, uncond_as_cond, 1.0)
    torch.testing.assert_close(v_cfg, v_uncond + 4.5 * (v_plain - v_uncond), atol=1e-4, rtol=0)


def test_velocity_is_differentiable(sd3_policy):
    embeds = sd3_policy.encode_prompts(PROMPTS[:1], with_uncond=False)
    sd3_policy.velocity(noise(sd3_policy, 1), torch.tensor([0.5]), embeds, 1.0).square().mean().backward()
    assert sd3_policy.transformer.proj_out.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in sd3_policy.pipe.text_encoder.parameters())


def test_euler_sampling_matches_the_pipeline(sd3_policy):
    """Same noise, 2 steps, CFG 4.5: the policy's ODE then decode == StableDiffusion3Pipeline."""
    x0 = noise(sd3_policy, 1, seed=5)
    embeds = sd3_policy.encode_prompts(PROMPTS[:1], with_uncond=True)
    ours = sd3_policy.decode(euler_sample(sd3_policy, x0, embeds, 4.5, steps=2))
    ref = sd3_policy.pipe(
        PROMPTS[0],
        num_inference_steps=2,
        height=RES,
        width=RES,
        guidance_scale=4.5,
        latents=x0,
        max_sequence_length=sd3_policy.max_sequence_length,
        output_type="pt",
    ).images
    assert ours.shape == (1, 3, RES, RES) and ours.dtype == torch.float32
    assert 0.0 <= ours.min() and ours.max() <= 1.0
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)


def test_bad_size_and_num_frames_are_config_errors(tiny_paths):
    with pytest.raises(ConfigError, match="height \\(40\\) must be a positive multiple of 16"):
        load_policy(tiny_paths["sd3"], height=40, width=RES)
    with pytest.raises(ConfigError, match="num_frames"):
        load_policy(tiny_paths["sd3"], height=RES, width=RES, num_frames=9)
