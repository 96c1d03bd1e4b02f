"""Cheap continuous rewards on raw pixels, for tests, the quickstart and the tiny models.

Both are plain means over pixels, so a video ``[B, F, 3, H, W]`` scores the mean over all its
frames (the same as the mean of per-frame scores). NaN pixels give a NaN score.
"""

from __future__ import annotations

from typing import Literal

import torch

from digen.errors import ConfigError
from digen.rewards.base import Metadata, Reward, check_batch
from digen.rewards.registry import register

_CHANNELS = {"red": 0, "green": 1, "blue": 2}


def _channel_means(images: torch.Tensor) -> torch.Tensor:
    """``[B, (F,) 3, H, W]`` -> float32 ``[B, 3]`` mean of each RGB channel."""
    x = images.detach().float().cpu()
    x = x.reshape(x.shape[0], -1, 3, x.shape[-2] * x.shape[-1])  # [B, F, 3, HW]
    return x.mean(dim=(1, 3))


@register("brightness")
class Brightness(Reward):
    """Mean pixel value in ``[0, 1]`` over channels, pixels (and frames)."""

    name = "brightness"

    def __call__(
        self, images: torch.Tensor, prompts: list[str], metadata: Metadata | None = None
    ) -> torch.Tensor:
        check_batch(images, prompts)
        return _channel_means(images).mean(dim=1)


@register("color")
class Color(Reward):
    """Mean of one channel minus the mean of the other two, in ``[-1, 1]``.

    Args:
        channel: ``"red" | "green" | "blue"``: the colour rewarded.
    """

    name = "color"

    def __init__(self, channel: Literal["red", "green", "blue"] = "red"):
        if channel not in _CHANNELS:
            raise ConfigError(f"color reward: channel {channel!r} is not one of {', '.join(_CHANNELS)}")
        self.channel = channel

    def __call__(
        self, images: torch.Tensor, prompts: list[str], metadata: Metadata | None = None
    ) -> torch.Tensor:
        check_batch(images, prompts)
        means = _channel_means(images)
        c = _CHANNELS[self.channel]
        others = [i for i in range(3) if i != c]
        return means[:, c] - means[:, others].mean(dim=1)
