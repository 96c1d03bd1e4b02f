"""Wan2.1 text-to-video (``WanPipeline``) as a :class:`FlowPolicy`, and its tiny builder.

Step space: the video latent ``[C=16, (F-1)/4 + 1, H/8, W/8]`` of ``AutoencoderKLWan``, normalised
with the VAE's per-channel ``latents_mean``/``latents_std``. The transformer takes
``timestep = 1000 * sigma`` (the pipeline passes ``scheduler.timesteps``) and UMT5 prompt
embeddings zero-padded to ``max_sequence_length`` (no mask). Guidance is true CFG with the empty
negative prompt, both halves in one batched forward.

Sigmas are the scheduler's after ``set_timesteps(num_steps)``, as the pipeline calls it: a
shifted Euler schedule for the tiny model's ``FlowMatchEulerDiscreteScheduler``, the flow
sigmas of the Hub's ``UniPCMultistepScheduler`` (``flow_shift``) for Wan2.1-T2V-Diffusers. UniPC
hands the transformer integer timesteps; digen always passes ``1000 * sigma`` unrounded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from digen.lora_targets import WAN_TARGETS
from digen.models import text
from digen.models.base import PromptEmbeds
from digen.models.tiny import _sub_seed, check_resolution
from digen.models.video import VideoPolicy


def unnormalize_latents(z: torch.Tensor, vae: Any) -> torch.Tensor:
    """Wan-style VAE input from a normalised latent ``z [B, C, F, h, w]``: ``z * std + mean``
    per channel, computed as the pipelines do (``z / (1 / std) + mean``). Qwen-Image's VAE is the
    same design and uses this too."""
    shape = (1, int(vae.config.z_dim), 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(z.device, z.dtype)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(z.device, z.dtype)
    return z / inv_std + mean


class WanPolicy(VideoPolicy):
    family = "wan"
    default_lora_targets = WAN_TARGETS
    default_max_sequence_length = 512  # WanPipeline's default UMT5 length
    default_num_frames = 81  # WanPipeline's default

    @property
    def spatial_patch(self) -> int:
        return int(self.config.patch_size[1])

    def _default_sequence_length(self) -> int:
        """512, capped by the tokenizer's ``model_max_length`` (the tiny model declares 32)."""
        return min(self.default_max_sequence_length, int(self.pipe.tokenizer.model_max_length))

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """``set_timesteps(num_steps)`` of the pipeline's scheduler, as ``WanPipeline`` calls it
        (static shift; no ``mu``). UniPC nudges a first sigma of 1 down to ``1 - 1e-6`` for its
        own multistep update; it is snapped back to 1 (else Flow-GRPO's noise scale
        ``sqrt(sigma / (1 - sigma))`` would be ~1000 on the first step). Returns
        ``[num_steps + 1]`` float32 on the host."""
        scheduler = self.pipe.scheduler
        scheduler.set_timesteps(num_steps)
        sigmas = scheduler.sigmas.to("cpu", torch.float32).clone()
        sigmas[(sigmas - 1.0).abs() < 1e-5] = 1.0
        return sigmas

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], *, with_uncond: bool) -> PromptEmbeds:
        """``encoder_hidden_states [B, max_sequence_length, D]`` (UMT5, zero-padded) via the
        pipeline's ``encode_prompt``; ``uncond`` from the empty prompt when asked."""
        cond, uncond = self.pipe.encode_prompt(
            prompt=list(prompts),
            do_classifier_free_guidance=with_uncond,
            max_sequence_length=self.max_sequence_length,
            device=self.device,
        )
        tensors = {"encoder_hidden_states": cond}
        return PromptEmbeds(tensors, {"encoder_hidden_states": uncond} if with_uncond else {})

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """latents ``[B, C, F', h, w]`` -> frames ``[B, F, 3, H, W]`` float32 in [0, 1]."""
        vae = self.pipe.vae
        z = unnormalize_latents(latents.to(vae.device, vae.dtype), vae)
        return self.to_frames(vae.decode(z, return_dict=False)[0])


# --- tiny model ------------------------------------------------------------------------
TEXT_DIM = 32  # tiny UMT5 width (the transformer's text_dim)


def build_tiny_wan(out_dir: Path, *, seed: int, resolution: int) -> None:
    """Write a tiny Wan2.1-T2V-style ``WanPipeline`` folder: a 2-block transformer (patch
    1x2x2, RMS qk-norm across heads), a 2-layer UMT5 encoder with the tiny T5 tokenizer, the
    causal 3D VAE (8x space, 4x time, 16 channels, Wan2.1's latent mean/std) and a shift-3
    Euler flow-matching scheduler."""
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )

    check_resolution(resolution)
    tokenizer = text.tiny_t5_tokenizer()
    transformer = text.seeded(
        _sub_seed(seed, 0),
        lambda: WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=2,
            attention_head_dim=16,
            in_channels=16,
            out_channels=16,
            text_dim=TEXT_DIM,
            freq_dim=32,
            ffn_dim=64,
            num_layers=2,
            rope_max_seq_len=32,
        ),
    )
    vae = text.seeded(
        _sub_seed(seed, 1),
        lambda: AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1),
    ).eval()
    pipe: Any = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text.tiny_t5_encoder(tokenizer, seed=_sub_seed(seed, 2), d_model=TEXT_DIM, umt5=True),
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
        transformer=transformer,
    )
    pipe.save_pretrained(out_dir)
