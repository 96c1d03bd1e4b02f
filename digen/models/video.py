"""What the text-to-video adapters (``wan.py``, ``hunyuan_video.py``) share: frame counts,
the ``[C, F', H/8, W/8]`` latent layout and frames out of the VAE.

Both video VAEs compress time 4x causally: ``num_frames = 4k + 1`` frames make ``k + 1`` latent
frames, the first latent frame standing for the first frame alone.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from digen.errors import ConfigError
from digen.models.pipeline_policy import PipelinePolicy


class VideoPolicy(PipelinePolicy):
    """A :class:`PipelinePolicy` whose step space is the video latent ``[C, F', h, w]``.

    Subclasses set ``default_num_frames`` (their pipeline's default) and
    ``spatial_patch`` (the transformer's patch size over ``h`` and ``w``).
    """

    is_video = True
    default_num_frames: ClassVar[int] = 81

    def __init__(self, pipe, *, num_frames: int | None = None, **kwargs):
        super().__init__(pipe, num_frames=num_frames, **kwargs)
        self.temporal_scale = int(pipe.vae_scale_factor_temporal)
        self.spatial_scale = int(pipe.vae_scale_factor_spatial)
        self.num_frames = self.default_num_frames if num_frames is None else int(num_frames)
        t = self.temporal_scale
        if self.num_frames < 1 or (self.num_frames - 1) % t:
            fix = max(1, (self.num_frames - 1) // t * t + 1)
            raise ConfigError(
                f"num_frames ({self.num_frames}) must be {t}k + 1 for {self.family} (the VAE compresses "
                f"time {t}x after the first frame); try {fix}"
            )
        self._check_multiple(
            self.spatial_scale * self.spatial_patch,
            f"VAE scale {self.spatial_scale} x patch {self.spatial_patch}",
        )

    @property
    def spatial_patch(self) -> int:
        raise NotImplementedError

    def latent_shape(self) -> tuple[int, int, int, int]:
        """``(C, (num_frames - 1) / 4 + 1, H / 8, W / 8)``."""
        s = self.spatial_scale
        frames = (self.num_frames - 1) // self.temporal_scale + 1
        return (int(self.config.in_channels), frames, self.height // s, self.width // s)

    @staticmethod
    def to_frames(video: torch.Tensor) -> torch.Tensor:
        """VAE output ``[B, 3, F, H, W]`` in [-1, 1] -> frames ``[B, F, 3, H, W]`` float32 in [0, 1]."""
        return (video.float().permute(0, 2, 1, 3, 4) / 2 + 0.5).clamp(0, 1)
