"""HunyuanVideoPolicy: video latents, Llama + CLIP prompts, embedded guidance, the byte-level
tokenizer fix, checked against HunyuanVideoPipeline on the tiny model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from digen.models import FlowPolicy, detect_family, load_policy

from ._family_checks import PROMPTS, check_folder_is_small, check_lora, check_velocity_rows
from ._helpers import RES, euler_sample, noise

FRAMES = 5  # 4k + 1: two latent frames
SEQ = 32  # Llama tokens per prompt (the pipeline's default is 256)


@pytest.fixture(scope="module")
def hv_path(tiny_models) -> Path:
    return tiny_models("hunyuan-video", RES)


@pytest.fixture
def hv(hv_path: Path) -> FlowPolicy:
    return load_policy(hv_path, height=RES, width=RES, num_frames=FRAMES, max_sequence_length=SEQ)


def test_tiny_folder_runs_in_hunyuan_video_pipeline(hv_path):
    from diffusers import HunyuanVideoPipeline

    check_folder_is_small(hv_path)
    pipe = HunyuanVideoPipeline.from_pretrained(hv_path, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    frames = pipe(
        PROMPTS[0],
        height=RES,
        width=RES,
        num_frames=FRAMES,
        num_inference_steps=2,
        max_sequence_length=SEQ,
        generator=torch.Generator().manual_seed(0),
        output_type="pt",
    ).frames
    assert frames.shape == (1, FRAMES, 3, RES, RES) and torch.isfinite(frames).all() and frames.std() > 0


def test_detected_and_loaded_as_hunyuan_video(hv_path, hv):
    from digen.models.hunyuan_video import HunyuanVideoPolicy

    assert detect_family(hv_path) == "hunyuan-video"
    assert isinstance(hv, HunyuanVideoPolicy) and hv.is_video and hv.guidance_embeds
    assert hv.latent_shape() == (16, 2, RES // 8, RES // 8)


def test_byte_level_tokenizer_is_reopened_as_is(hv_path, hv):
    """diffusers opens the Hub-style folder with transformers' LlamaTokenizer, which re-tokenizes
    SentencePiece-style; the policy's tokenizer cuts the template where crop_start says."""
    from diffusers import HunyuanVideoPipeline
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE
    from transformers import LlamaTokenizer

    raw = HunyuanVideoPipeline.from_pretrained(hv_path, local_files_only=True).tokenizer
    prefix = DEFAULT_PROMPT_TEMPLATE["template"].split("{}")[0]
    assert isinstance(raw, LlamaTokenizer) and len(raw(prefix).input_ids) != 95
    tok = hv.pipe.tokenizer
    ids = tok(prefix).input_ids
    assert len(ids) == DEFAULT_PROMPT_TEMPLATE["crop_start"] == 95 and ids[0] == tok.bos_token_id
    assert tok.decode(tok(PROMPTS[1], add_special_tokens=False).input_ids) == PROMPTS[1]
    assert tok.padding_side == "right"


def test_sigmas_are_the_pipelines(hv):
    sigmas = hv.sigmas(4)
    plain = np.linspace(1.0, 0.0, 5)[:-1]
    torch.testing.assert_close(sigmas[:-1], torch.tensor(7 * plain / (1 + 6 * plain)).float())
    assert sigmas.shape == (5,) and sigmas[-1] == 0.0


def test_embeds_and_velocity_rows(hv):
    embeds = hv.encode_prompts(PROMPTS, with_uncond=False)
    mask = embeds.tensors["encoder_attention_mask"]
    assert embeds.tensors["encoder_hidden_states"].shape == (2, SEQ, 32) and mask.shape == (2, SEQ)
    assert embeds.tensors["pooled_projections"].shape == (2, 32)
    assert 0 < mask[0].sum() < mask[1].sum() < SEQ and (mask.diff(dim=1) <= 0).all()  # right padding
    check_velocity_rows(hv, embeds, 6.0)


def test_guidance_is_embedded_not_a_second_pass(hv):
    with_uncond = hv.encode_prompts(PROMPTS, with_uncond=True)
    plain = hv.encode_prompts(PROMPTS, with_uncond=False)
    x, sigmas = noise(hv, 2), torch.tensor([0.8, 0.8])
    v = hv.velocity(x, sigmas, with_uncond, 6.0)
    torch.testing.assert_close(v, hv.velocity(x, sigmas, plain, 6.0))
    assert (v - hv.velocity(x, sigmas, plain, 1.0)).abs().max() > 1e-4


def test_euler_sampling_and_decode_match_the_pipeline(hv):
    """Same noise, 2 steps, embedded guidance 6: policy == HunyuanVideoPipeline."""
    x0 = noise(hv, 1, seed=5)
    embeds = hv.encode_prompts(PROMPTS[:1], with_uncond=False)
    ours = hv.decode(euler_sample(hv, x0, embeds, 6.0, steps=2))
    ref = hv.pipe(
        PROMPTS[0],
        height=RES,
        width=RES,
        num_frames=FRAMES,
        num_inference_steps=2,
        guidance_scale=6.0,
        latents=x0,
        max_sequence_length=SEQ,
        output_type="pt",
    ).frames
    assert ours.shape == (1, FRAMES, 3, RES, RES) and 0.0 <= ours.min() and ours.max() <= 1.0
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)


def test_lora_starts_at_base_and_syncs_only_the_adapter(hv):
    embeds = hv.encode_prompts(PROMPTS, with_uncond=False)
    check_lora(hv, embeds, 6.0, expect=("attn.to_q", "attn.add_k_proj", "attn.to_out.0", "attn.to_add_out"))
    state = hv.trainable_state_dict()
    assert any(k.startswith("single_transformer_blocks.0.attn.to_v.") for k in state)
