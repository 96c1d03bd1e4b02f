"""JPEG file size as a reward: the DDPO / Flow-GRPO compressibility task.

Each image is quantised to uint8 (``round(x * 255)``), saved by PIL as a quality-95 JPEG, and
its size taken in kB (bytes / 1000). Flow-GRPO's scores, which these reproduce by default:

- ``jpeg_compressibility`` = ``-size_kB / 500`` (smaller files score higher);
- ``jpeg_incompressibility`` = ``+size_kB`` (no division).

Video ``[B, F, 3, H, W]``: every frame is compressed on its own; the score is the mean over
frames. A sample with a non-finite pixel scores NaN.
"""

from __future__ import annotations

import io

import torch
from PIL import Image

from digen.rewards.base import (
    Metadata,
    Reward,
    check_batch,
    finite_rows,
    flatten_frames,
    mean_over_frames,
    to_uint8,
)
from digen.rewards.registry import register


def jpeg_size_kb(images: torch.Tensor, quality: int = 95) -> torch.Tensor:
    """Size in kB (1 kB = 1000 bytes) of each image saved as a JPEG.

    Args:
        images: ``[N, 3, H, W]`` float in ``[0, 1]``.
        quality: PIL JPEG quality (1..95).

    Returns:
        float32 ``[N]``.
    """
    sizes = []
    for pixels in to_uint8(images):
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="JPEG", quality=quality)
        sizes.append(buf.tell() / 1000)
    return torch.tensor(sizes, dtype=torch.float32)


class _JpegSize(Reward):
    """``sign * scale * size_kB``, mean over video frames."""

    sign = 1.0

    def __init__(self, scale: float, quality: int = 95):
        self.scale = float(scale)
        self.quality = int(quality)

    def __call__(
        self, images: torch.Tensor, prompts: list[str], metadata: Metadata | None = None
    ) -> torch.Tensor:
        check_batch(images, prompts)
        frames, n_frames = flatten_frames(images)
        per_frame = self.sign * self.scale * jpeg_size_kb(frames, self.quality)
        per_frame[~finite_rows(frames)] = float("nan")
        return mean_over_frames(per_frame, n_frames)


@register("jpeg_compressibility")
class JpegCompressibility(_JpegSize):
    """``-size_kB * scale`` of a quality-95 JPEG; ``scale`` defaults to Flow-GRPO's 1/500."""

    name = "jpeg_compressibility"
    sign = -1.0

    def __init__(self, scale: float = 1 / 500, quality: int = 95):
        super().__init__(scale, quality)


@register("jpeg_incompressibility")
class JpegIncompressibility(_JpegSize):
    """``+size_kB * scale`` of a quality-95 JPEG; ``scale`` defaults to 1 as in Flow-GRPO."""

    name = "jpeg_incompressibility"
    sign = 1.0

    def __init__(self, scale: float = 1.0, quality: int = 95):
        super().__init__(scale, quality)
