"""QwenImagePolicy: packed latents, masked Qwen2.5-VL prompts, rescaled true CFG, checked
against QwenImagePipeline on the tiny model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from digen.models import FlowPolicy, PromptEmbeds, detect_family, load_policy, make_tiny_model

from ._family_checks import PROMPTS, check_folder_is_small, check_lora, check_velocity_rows
from ._helpers import RES, euler_sample, noise


@pytest.fixture(scope="module")
def qwen_path(tiny_models) -> Path:
    return tiny_models("qwen-image", RES)


@pytest.fixture
def qwen(qwen_path: Path) -> FlowPolicy:
    return load_policy(qwen_path, height=RES, width=RES)


def test_tiny_folder_runs_in_qwen_image_pipeline(qwen_path):
    from diffusers import QwenImagePipeline

    check_folder_is_small(qwen_path)
    pipe = QwenImagePipeline.from_pretrained(qwen_path, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    images = pipe(
        PROMPTS[0],
        negative_prompt=" ",
        true_cfg_scale=4.0,
        height=RES,
        width=RES,
        num_inference_steps=2,
        generator=torch.Generator().manual_seed(0),
        output_type="pt",
    ).images
    assert images.shape == (1, 3, RES, RES) and torch.isfinite(images).all() and images.std() > 0


def test_detected_and_loaded_as_qwen_image(qwen_path, qwen):
    from digen.models.qwen_image import QwenImagePolicy

    assert detect_family(qwen_path) == "qwen-image"
    assert isinstance(qwen, QwenImagePolicy) and not qwen.is_video
    assert qwen.latent_shape() == ((RES // 16) ** 2, 64)


def test_template_prefix_is_what_the_pipeline_drops(qwen):
    pipe = qwen.pipe
    prefix = pipe.prompt_template_encode.split("{}")[0]
    assert len(pipe.tokenizer(prefix).input_ids) == pipe.prompt_template_encode_start_idx == 34
    embeds = qwen.encode_prompts(PROMPTS, with_uncond=True)
    states, mask = embeds.tensors["encoder_hidden_states"], embeds.tensors["encoder_hidden_states_mask"]
    assert states.shape[:2] == mask.shape and states.shape[2] == 32
    assert mask[0].sum() < mask[1].sum() == mask.shape[1]  # the shorter prompt is padded
    assert embeds.uncond["encoder_hidden_states"].shape[0] == 2


def test_sigmas_use_dynamic_shift_and_terminal_stretch(qwen, qwen_path):
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    sigmas = qwen.sigmas(4)
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(qwen_path, subfolder="scheduler")
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.25, 4), mu=calculate_shift(4, 256, 8192, 0.5, 0.9))
    torch.testing.assert_close(sigmas, scheduler.sigmas)
    assert sigmas.shape == (5,) and sigmas[0] == 1.0 and sigmas[-1] == 0.0
    assert sigmas[-2].item() == pytest.approx(0.02)  # shift_terminal


def test_velocity_rows_with_masked_prompts(qwen):
    check_velocity_rows(qwen, qwen.encode_prompts(PROMPTS, with_uncond=True), 4.0)


def test_true_cfg_is_two_passes_rescaled_to_the_cond_norm(qwen):
    embeds = qwen.encode_prompts(PROMPTS, with_uncond=True)
    x, sigmas = noise(qwen, 2), torch.tensor([0.7, 0.7])
    cond = qwen.velocity(x, sigmas, PromptEmbeds(embeds.tensors), 4.0)
    uncond = qwen.velocity(x, sigmas, PromptEmbeds(embeds.uncond), 4.0)
    combined = uncond + 4.0 * (cond - uncond)
    expected = combined * cond.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True)
    guided = qwen.velocity(x, sigmas, embeds, 4.0)
    torch.testing.assert_close(guided, expected)
    assert not torch.allclose(guided, combined, atol=1e-3)
    torch.testing.assert_close(qwen.velocity(x, sigmas, embeds, 1.0), cond)


def test_euler_sampling_and_decode_match_the_pipeline(qwen):
    """Same packed noise, 2 steps, true CFG 4 with the " " negative prompt: policy == pipeline."""
    x0 = noise(qwen, 1, seed=5)
    embeds = qwen.encode_prompts(PROMPTS[:1], with_uncond=True)
    ours = qwen.decode(euler_sample(qwen, x0, embeds, 4.0, steps=2))
    ref = qwen.pipe(
        PROMPTS[0],
        negative_prompt=" ",
        true_cfg_scale=4.0,
        height=RES,
        width=RES,
        num_inference_steps=2,
        latents=x0,
        max_sequence_length=qwen.max_sequence_length,
        output_type="pt",
    ).images
    assert ours.shape == (1, 3, RES, RES) and 0.0 <= ours.min() and ours.max() <= 1.0
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)


def test_lora_starts_at_base_and_syncs_only_the_adapter(qwen):
    embeds = qwen.encode_prompts(PROMPTS, with_uncond=True)
    check_lora(qwen, embeds, 4.0, expect=("attn.to_q", "attn.add_q_proj", "attn.to_out.0", "attn.to_add_out"))


def test_same_seed_same_weights(qwen_path, tmp_path):
    from safetensors.torch import load_file

    again = make_tiny_model(tmp_path / "again", "qwen-image", resolution=RES)
    for part in ("transformer", "text_encoder", "vae"):
        a, b = (load_file(next((p / part).glob("*.safetensors"))) for p in (qwen_path, again))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_cfg_grad_cond_detaches_the_negative_prompt_pass(qwen):
    """``cfg_grad="cond"``: the same guided velocity, but only the conditional pass carries
    gradient (``train.cfg_grad``); ``"both"`` back-propagates through both passes."""
    from digen.models.qwen_image import rescaled_cfg

    qwen.enable_lora(2, 4)
    gen = torch.Generator().manual_seed(0)
    qwen.load_trainable_state_dict(
        {k: 0.1 * torch.randn(v.shape, generator=gen) for k, v in qwen.trainable_state_dict().items()}
    )
    embeds = qwen.encode_prompts(PROMPTS, with_uncond=True)
    x, sigmas = noise(qwen, 2), torch.tensor([0.7, 0.7])
    weight = torch.randn(x.shape, generator=gen)

    def grad(make):
        params = qwen.trainable_parameters()
        value = make()
        gs = torch.autograd.grad((value * weight).sum(), params, allow_unused=True)
        return value.detach(), torch.cat(
            [(g if g is not None else torch.zeros_like(p)).flatten() for g, p in zip(gs, params, strict=True)]
        )

    v_cond, g_cond = grad(lambda: qwen.velocity(x, sigmas, embeds, 4.0, cfg_grad="cond"))
    v_both, g_both = grad(lambda: qwen.velocity(x, sigmas, embeds, 4.0, cfg_grad="both"))
    _, g_manual = grad(
        lambda: rescaled_cfg(
            qwen.velocity(x, sigmas, PromptEmbeds(embeds.tensors), 4.0),
            qwen.velocity(x, sigmas, PromptEmbeds(embeds.uncond), 4.0).detach(),
            4.0,
        )
    )
    torch.testing.assert_close(v_cond, v_both)
    torch.testing.assert_close(g_cond, g_manual)
    assert (g_cond - g_both).norm() > 1e-3 * g_both.norm()


def test_prompts_of_different_lengths_stack_padded_as_the_pipeline_pads(qwen):
    """A batched train task stacks groups encoded by separate calls (``train.groups_per_task``):
    Qwen-Image's prompt length is the longest of each call, so the shorter is padded (zeros,
    mask 0) and each row's velocity equals its own call's."""
    alone = [qwen.encode_prompts([p], with_uncond=True) for p in PROMPTS]
    lengths = [e.tensors["encoder_hidden_states"].shape[1] for e in alone]
    assert lengths[0] < lengths[1]
    both = PromptEmbeds.cat(alone)
    assert both.tensors["encoder_hidden_states"].shape[1] == lengths[1]
    assert both.tensors["encoder_hidden_states_mask"][0].sum() == lengths[0]
    together = qwen.encode_prompts(PROMPTS, with_uncond=True)  # the pipeline's own padding
    for k, v in together.tensors.items():
        torch.testing.assert_close(both.tensors[k], v, atol=1e-5, rtol=0)
    x, sigmas = noise(qwen, 2), torch.tensor([0.7, 0.4])
    stacked = qwen.velocity(x, sigmas, both, 4.0)
    for row, e in enumerate(alone):
        own = qwen.velocity(x[row : row + 1], sigmas[row : row + 1], e, 4.0)
        torch.testing.assert_close(stacked[row : row + 1], own, atol=1e-5, rtol=1e-5)


def test_prompt_embeddings_without_a_padding_mask_do_not_stack_padded():
    a = PromptEmbeds({"encoder_hidden_states": torch.zeros(1, 3, 4)})
    b = PromptEmbeds({"encoder_hidden_states": torch.zeros(1, 5, 4)})
    with pytest.raises(ValueError, match="padding mask"):
        PromptEmbeds.cat([a, b])
