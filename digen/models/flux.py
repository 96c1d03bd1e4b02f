"""FLUX.1 (``FluxPipeline``) as a :class:`FlowPolicy`.

Step space: the packed latent ``[seq = (H/16)(W/16), C*4 = 64]`` (2x2 patches of the
``[16, H/8, W/8]`` VAE latent, ``FluxPipeline._pack_latents``), with the latent image ids the
adapter holds. The transformer takes ``timestep = sigma`` (the pipeline divides its timesteps
by 1000; the model multiplies back), ``guidance = guidance_scale`` when it has a guidance
embedding (FLUX.1-dev: embedded guidance, no second pass), ``encoder_hidden_states`` (T5),
``pooled_projections`` (CLIP pooled) and all-zero text ids. A transformer without guidance
embedding (FLUX.1-schnell) uses true CFG when the embeds carry ``uncond``.
"""

from __future__ import annotations

from typing import Any

import torch

from digen.models import lora
from digen.models.packed import PackedLatentPolicy


class FluxPolicy(PackedLatentPolicy):
    family = "flux"
    default_lora_targets = lora.FLUX_TARGETS
    default_max_sequence_length = 512  # FluxPipeline's default T5 length

    def __init__(self, pipe, **kwargs):
        super().__init__(pipe, **kwargs)
        h, w = self._grid()
        self.latent_image_ids = pipe._prepare_latent_image_ids(1, h, w, self.device, self.dtype)

    def _encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """``encoder_hidden_states [B, L, D]`` (T5), ``pooled_projections [B, P]`` (CLIP) via
        the pipeline's ``encode_prompt``; ``uncond`` encodes the empty prompt."""
        embeds, pooled, _ = self.pipe.encode_prompt(
            prompt=prompts, prompt_2=None, device=self.device, max_sequence_length=self.max_sequence_length
        )
        return {"encoder_hidden_states": embeds, "pooled_projections": pooled}

    def transformer_kwargs(
        self, x: torch.Tensor, tensors: dict[str, torch.Tensor], guidance_scale: float
    ) -> dict[str, Any]:
        """The prompt tensors, all-zero ``txt_ids [L, 3]`` and the latent image ids in the model
        dtype, and ``guidance [N]`` float32 (None without guidance embedding), as
        ``FluxPipeline.__call__`` builds them."""
        kwargs = super().transformer_kwargs(x, tensors, guidance_scale)
        guidance = None
        if self.guidance_embeds:
            guidance = torch.full(
                (x.shape[0],), float(guidance_scale), device=self.device, dtype=torch.float32
            )
        txt_ids = torch.zeros(
            kwargs["encoder_hidden_states"].shape[1], 3, device=self.device, dtype=self.dtype
        )
        return {**kwargs, "guidance": guidance, "txt_ids": txt_ids, "img_ids": self.latent_image_ids}

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Packed latents ``[B, seq, C*4]`` -> images ``[B, 3, H, W]`` float32 in [0, 1]."""
        vae = self.pipe.vae
        z = self.unpack(latents).to(vae.device, vae.dtype) / vae.config.scaling_factor + (
            vae.config.shift_factor or 0.0
        )
        image = vae.decode(z, return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)
