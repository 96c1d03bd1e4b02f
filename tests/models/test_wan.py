"""WanPolicy: video latents, UMT5 prompts, batched true CFG, checked against WanPipeline on the
tiny model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from digen.errors import ConfigError
from digen.models import FlowPolicy, detect_family, load_policy

from ._family_checks import PROMPTS, check_folder_is_small, check_lora, check_velocity_rows
from ._helpers import RES, euler_sample, noise

FRAMES = 5  # 4k + 1: two latent frames


@pytest.fixture(scope="module")
def wan_path(tiny_models) -> Path:
    return tiny_models("wan", RES)


@pytest.fixture
def wan(wan_path: Path) -> FlowPolicy:
    return load_policy(wan_path, height=RES, width=RES, num_frames=FRAMES)


def test_tiny_folder_runs_in_wan_pipeline(wan_path):
    from diffusers import WanPipeline

    check_folder_is_small(wan_path)
    pipe = WanPipeline.from_pretrained(wan_path, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    frames = pipe(
        PROMPTS[0],
        height=RES,
        width=RES,
        num_frames=FRAMES,
        num_inference_steps=2,
        max_sequence_length=32,
        generator=torch.Generator().manual_seed(0),
        output_type="pt",
    ).frames
    assert frames.shape == (1, FRAMES, 3, RES, RES) and torch.isfinite(frames).all() and frames.std() > 0


def test_detected_and_loaded_as_wan(wan_path, wan):
    from digen.models.wan import WanPolicy

    assert detect_family(wan_path) == "wan"
    assert isinstance(wan, WanPolicy) and wan.is_video
    assert wan.latent_shape() == (16, 2, RES // 8, RES // 8)
    assert wan.max_sequence_length == 32  # capped by the tiny tokenizer


def test_num_frames_must_fit_the_vae(wan_path):
    with pytest.raises(ConfigError, match=r"num_frames \(6\) must be 4k \+ 1 for wan .*try 5"):
        load_policy(wan_path, height=RES, width=RES, num_frames=6)
    assert load_policy(wan_path, height=RES, width=RES).num_frames == 81  # the pipeline's default


def test_sigmas_follow_the_scheduler(wan):
    from diffusers import UniPCMultistepScheduler

    def shift(s):
        return 3 * s / (1 + 2 * s)

    # tiny: FlowMatchEuler, shift 3, linear from 1 to its (already shifted) smallest sigma
    sigmas = wan.sigmas(4)
    torch.testing.assert_close(sigmas[:-1], torch.tensor(shift(np.linspace(1.0, shift(1e-3), 4))).float())
    assert sigmas[-1] == 0.0
    # The Hub's Wan2.1 scheduler: UniPC flow sigmas with flow_shift, as WanPipeline would set them.
    wan.pipe.scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
    )
    flow = shift(np.linspace(1.0, 1e-3, 5)[:-1])
    sigmas = wan.sigmas(4)
    assert wan.pipe.scheduler.sigmas[0] < 1.0  # UniPC's own 1 - 1e-6, snapped back to 1 by the policy
    torch.testing.assert_close(sigmas, torch.tensor([*flow, 0.0], dtype=torch.float32))
    assert sigmas[0] == 1.0


def test_velocity_rows(wan):
    check_velocity_rows(wan, wan.encode_prompts(PROMPTS, with_uncond=True), 5.0)


def test_cfg_uses_the_empty_prompt(wan):
    embeds = wan.encode_prompts(PROMPTS, with_uncond=True)
    assert embeds.tensors["encoder_hidden_states"].shape == (2, 32, 32)
    empty = wan.encode_prompts(["", ""], with_uncond=False)
    torch.testing.assert_close(embeds.uncond["encoder_hidden_states"], empty.tensors["encoder_hidden_states"])


def test_euler_sampling_and_decode_match_the_pipeline(wan):
    """Same noise, 2 steps, CFG 5 with the empty negative prompt: policy == WanPipeline."""
    x0 = noise(wan, 1, seed=5)
    embeds = wan.encode_prompts(PROMPTS[:1], with_uncond=True)
    ours = wan.decode(euler_sample(wan, x0, embeds, 5.0, steps=2))
    ref = wan.pipe(
        PROMPTS[0],
        height=RES,
        width=RES,
        num_frames=FRAMES,
        num_inference_steps=2,
        guidance_scale=5.0,
        latents=x0,
        max_sequence_length=wan.max_sequence_length,
        output_type="pt",
    ).frames
    assert ours.shape == (1, FRAMES, 3, RES, RES) and 0.0 <= ours.min() and ours.max() <= 1.0
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)


def test_lora_starts_at_base_and_syncs_only_the_adapter(wan):
    embeds = wan.encode_prompts(PROMPTS, with_uncond=True)
    check_lora(wan, embeds, 5.0, expect=("attn1.to_q", "attn1.to_out.0", "attn2.to_k", "attn2.to_v"))
