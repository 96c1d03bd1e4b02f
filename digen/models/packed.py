"""What the packed-latent image adapters (``flux.py``, ``qwen_image.py``) share: the 2x2-packed
latent layout, and their pipelines' sigma schedule and timestep convention.

Both pipelines pack the 16-channel VAE latent ``[C, H/8, W/8]`` into 2x2 patches, one token
each: ``[seq = (H/16)(W/16), C*4 = 64]`` (``FluxPipeline._pack_latents``, which
``QwenImagePipeline._pack_latents`` copies), and both hand the transformer
``timestep = t.to(latents.dtype) / 1000`` (the model multiplies back).
"""

from __future__ import annotations

import torch

from digen.models.pipeline_policy import PipelinePolicy


class PackedLatentPolicy(PipelinePolicy):
    """A :class:`PipelinePolicy` whose step space is the packed latent ``[seq, C*4]``."""

    def __init__(self, pipe, **kwargs):
        super().__init__(pipe, **kwargs)
        self.vae_scale_factor = int(pipe.vae_scale_factor)
        self._check_multiple(2 * self.vae_scale_factor, f"VAE scale {self.vae_scale_factor} x 2x2 packing")

    def _grid(self) -> tuple[int, int]:
        """Packed token grid ``(H / (2 * vae_scale), W / (2 * vae_scale))``."""
        f = 2 * self.vae_scale_factor
        return self.height // f, self.width // f

    def latent_shape(self) -> tuple[int, int]:
        """``(seq, C * 4)`` of the packed latent."""
        h, w = self._grid()
        return (h * w, int(self.config.in_channels))

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """As the FLUX and Qwen-Image pipelines set them: linear sigmas ``1 -> 1/num_steps``
        (none when the scheduler config sets ``use_flow_sigmas``, as ``FluxPipeline`` checks)
        through the scheduler's shift, ``mu`` from the image token count (``calculate_shift``,
        which ``QwenImagePipeline`` copies from ``FluxPipeline``); Qwen-Image's config also
        stretches them to end at ``shift_terminal``. Returns ``[num_steps + 1]`` float32 on
        the host."""
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
        return scheduler.sigmas.to("cpu", torch.float32).clone()

    def timesteps(self, sigmas: torch.Tensor) -> torch.Tensor:
        """sigmas ``[B]`` float32 -> ``(1000 * sigma).to(model dtype) / 1000`` ``[B]``, as the
        FLUX and Qwen-Image pipelines compute ``timestep.to(latents.dtype) / 1000``."""
        return (sigmas * 1000.0).to(self.dtype) / 1000.0

    def unpack(self, latents: torch.Tensor) -> torch.Tensor:
        """Packed latents ``[B, seq, C*4]`` -> the VAE's ``[B, C, H/8, W/8]`` (Qwen-Image's
        ``_unpack_latents`` adds a frame dim: ``[B, C, 1, H/8, W/8]``)."""
        return self.pipe._unpack_latents(latents, self.height, self.width, self.vae_scale_factor)
