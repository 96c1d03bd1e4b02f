"""Stable Diffusion 3 / 3.5 (``StableDiffusion3Pipeline``) as a :class:`FlowPolicy`.

Step space: the VAE latent ``[C=16, H/8, W/8]``. The MMDiT takes ``timestep = 1000 * sigma``
(the pipeline passes ``scheduler.timesteps``, which are ``sigmas * 1000``), prompt embeddings
``encoder_hidden_states [B, 77 + L, D]`` (CLIP-L|CLIP-G padded to T5's width, then T5) and
``pooled_projections [B, 2048]``. Guidance is true CFG with the empty prompt.
"""

from __future__ import annotations

import torch

from digen.models import lora
from digen.models.base import PromptEmbeds
from digen.models.pipeline_policy import PipelinePolicy


class Sd3Policy(PipelinePolicy):
    family = "sd3"
    default_lora_targets = lora.SD3_TARGETS
    default_max_sequence_length = 128  # Flow-GRPO's T5 length for SD3.5

    def __init__(self, pipe, **kwargs):
        super().__init__(pipe, **kwargs)
        self.vae_scale_factor = int(pipe.vae_scale_factor)
        self._check_multiple(
            self.vae_scale_factor * int(self.config.patch_size),
            f"VAE scale {self.vae_scale_factor} x patch {self.config.patch_size}",
        )

    def latent_shape(self) -> tuple[int, int, int]:
        """``(C, H / vae_scale, W / vae_scale)``."""
        f = self.vae_scale_factor
        return (int(self.config.in_channels), self.height // f, self.width // f)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """As the pipeline sets them: ``set_timesteps(num_steps)`` (static shift 3.0 for SD3.5;
        resolution-dependent ``mu`` if the scheduler config asks for dynamic shifting).
        Returns ``[num_steps + 1]`` float32 on the host (:meth:`FlowPolicy.sigmas`)."""
        from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

        scheduler = self.pipe.scheduler
        kwargs = {}
        if scheduler.config.get("use_dynamic_shifting", False):
            _, h, w = self.latent_shape()
            patch = int(self.config.patch_size)
            kwargs["mu"] = calculate_shift(
                (h // patch) * (w // patch),
                scheduler.config.get("base_image_seq_len", 256),
                scheduler.config.get("max_image_seq_len", 4096),
                scheduler.config.get("base_shift", 0.5),
                scheduler.config.get("max_shift", 1.16),
            )
        scheduler.set_timesteps(num_steps, **kwargs)
        return scheduler.sigmas.to("cpu", torch.float32).clone()

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], *, with_uncond: bool) -> PromptEmbeds:
        """``encoder_hidden_states [B, 77 + L, D]``, ``pooled_projections [B, P]`` via the
        pipeline's ``encode_prompt``; ``uncond`` from the empty prompt when ``with_uncond``."""
        cond, uncond, pooled, uncond_pooled = self.pipe.encode_prompt(
            prompt=list(prompts),
            prompt_2=None,
            prompt_3=None,
            device=self.device,
            do_classifier_free_guidance=with_uncond,
            max_sequence_length=self.max_sequence_length,
        )
        tensors = {"encoder_hidden_states": cond, "pooled_projections": pooled}
        if not with_uncond:
            return PromptEmbeds(tensors)
        return PromptEmbeds(tensors, {"encoder_hidden_states": uncond, "pooled_projections": uncond_pooled})

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """latents ``[B, C, h, w]`` -> images ``[B, 3, H, W]`` float32 in [0, 1]."""
        vae = self.pipe.vae
        z = latents.to(vae.device, vae.dtype) / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)
        image = vae.decode(z, return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)
