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

import torch

from digen.models import lora
from digen.models.base import PromptEmbeds
from digen.models.pipeline_policy import PipelinePolicy


class FluxPolicy(PipelinePolicy):
    family = "flux"
    default_lora_targets = lora.FLUX_TARGETS
    default_max_sequence_length = 512  # FluxPipeline's default T5 length

    def __init__(self, pipe, **kwargs):
        super().__init__(pipe, **kwargs)
        self.vae_scale_factor = int(pipe.vae_scale_factor)
        self._check_multiple(2 * self.vae_scale_factor, f"VAE scale {self.vae_scale_factor} x 2x2 packing")
        h, w = self._grid()
        self.latent_image_ids = pipe._prepare_latent_image_ids(1, h, w, self.device, self.dtype)

    def _grid(self) -> tuple[int, int]:
        """Packed token grid ``(H / (2 * vae_scale), W / (2 * vae_scale))``."""
        f = 2 * self.vae_scale_factor
        return self.height // f, self.width // f

    def latent_shape(self) -> tuple[int, int]:
        """``(seq, C * 4)`` of the packed latent."""
        h, w = self._grid()
        return (h * w, int(self.config.in_channels))

    @property
    def guidance_embeds(self) -> bool:
        return bool(self.config.get("guidance_embeds", False))

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """As ``FluxPipeline`` sets them: linear sigmas ``1 -> 1/num_steps``, shifted with
        ``mu`` from the image token count. Returns ``[num_steps + 1]`` float32 on device."""
        import numpy as np
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        scheduler = self.pipe.scheduler
        config = scheduler.config
        sigmas = None if config.get("use_flow_sigmas", False) else np.linspace(1.0, 1 / num_steps, num_steps)
        mu = calculate_shift(
            self.latent_shape()[0],
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        scheduler.set_timesteps(num_steps, sigmas=sigmas, mu=mu)
        return scheduler.sigmas.to(self.device, torch.float32).clone()

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], *, with_uncond: bool) -> PromptEmbeds:
        """``encoder_hidden_states [B, L, D]`` (T5), ``pooled_projections [B, P]`` (CLIP) via
        the pipeline's ``encode_prompt``; ``uncond`` from the empty prompt when asked."""
        tensors = self._encode(list(prompts))
        uncond = self._encode([""] * len(prompts)) if with_uncond else {}
        return PromptEmbeds(tensors, uncond)

    def _encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        embeds, pooled, _ = self.pipe.encode_prompt(
            prompt=prompts, prompt_2=None, device=self.device, max_sequence_length=self.max_sequence_length
        )
        return {"encoder_hidden_states": embeds, "pooled_projections": pooled}

    def velocity(
        self,
        latents: torch.Tensor,
        sigmas: torch.Tensor,
        embeds: PromptEmbeds,
        guidance_scale: float,
        cfg_grad: str = "both",
    ) -> torch.Tensor:
        """latents ``[B, seq, C*4]`` float32, sigmas ``[B]`` -> velocity ``[B, seq, C*4]``."""
        cfg = not self.guidance_embeds and self.uses_cfg(embeds, guidance_scale)
        x = latents.to(self.device, self.dtype)
        # The pipeline: timestep = (1000 * sigma).to(dtype) / 1000.
        t = (sigmas.to(self.device, torch.float32) * 1000.0).to(self.dtype) / 1000.0
        if cfg:
            x, t = torch.cat([x, x]), torch.cat([t, t])
        kwargs = self._embed_kwargs(embeds, cfg)
        guidance = None
        if self.guidance_embeds:
            guidance = torch.full(
                (x.shape[0],), float(guidance_scale), device=self.device, dtype=torch.float32
            )
        txt_ids = torch.zeros(
            kwargs["encoder_hidden_states"].shape[1], 3, device=self.device, dtype=self.dtype
        )
        out = self.transformer(
            hidden_states=x,
            timestep=t,
            guidance=guidance,
            txt_ids=txt_ids,
            img_ids=self.latent_image_ids,
            **kwargs,
            return_dict=False,
        )[0]
        return self._combine_cfg(out, guidance_scale, cfg_grad) if cfg else out.float()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Packed latents ``[B, seq, C*4]`` -> images ``[B, 3, H, W]`` float32 in [0, 1]."""
        vae = self.pipe.vae
        z = self.pipe._unpack_latents(latents, self.height, self.width, self.vae_scale_factor)
        z = z.to(vae.device, vae.dtype) / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)
        image = vae.decode(z, return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)
