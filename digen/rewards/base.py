"""The interface every reward sits behind, and the helpers rewards share.

A reward scores decoded samples against their prompts:

- images: float32 ``[B, 3, H, W]`` in ``[0, 1]``; video: ``[B, F, 3, H, W]``.
- prompts: ``list[str]`` of length ``B``.
- metadata (optional): ``list[dict]`` of length ``B``, the per-prompt metadata of a
  GenEval-style prompt dataset (``prompts.dataset`` with ``*_metadata.jsonl``); ``None`` when
  the prompts carry none. Rewards that do not use it ignore it.
- returns: float32 ``[B]`` on the CPU, higher is better. A sample the reward could not score
  gets ``NaN`` (or ``inf``); :func:`filter_finite` keeps such samples out of the update.

How each built-in reward treats video frames is written in its docstring (the rule is: score
every frame as an image, then take the mean over frames, unless a reward says otherwise).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from digen.errors import RewardError

log = logging.getLogger(__name__)

Metadata = list[dict[str, Any]]
"""Per-sample prompt metadata (one JSON object per sample)."""


class Reward(ABC):
    """A scorer of generated samples. Subclasses set ``name`` and implement ``__call__``."""

    name: str = ""

    @abstractmethod
    def __call__(
        self, images: torch.Tensor, prompts: list[str], metadata: Metadata | None = None
    ) -> torch.Tensor:
        """Score a batch.

        Args:
            images: ``[B, 3, H, W]`` or video ``[B, F, 3, H, W]``, float in ``[0, 1]``.
            prompts: ``B`` prompts, one per sample.
            metadata: ``B`` per-prompt metadata dicts, or None (see the module docstring).

        Returns:
            scores: float32 ``[B]`` on the CPU; NaN/inf marks a sample that failed.
        """

    def close(self) -> None:  # noqa: B027 (optional hook, not abstract)
        """Release what the reward holds (models, HTTP sessions). Default: nothing."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def call_reward(
    reward: Callable[..., torch.Tensor], images: torch.Tensor, prompts: list[str], metadata: Metadata | None
) -> torch.Tensor:
    """``reward(images, prompts[, metadata])``: metadata is passed only when there is some, so a
    reward written as ``__call__(images, prompts)`` keeps working."""
    return reward(images, prompts) if metadata is None else reward(images, prompts, metadata)


def check_batch(images: torch.Tensor, prompts: list[str], metadata: Metadata | None = None) -> None:
    """Raise :class:`RewardError` unless ``images`` is ``[B, (F,) 3, H, W]`` with ``B`` prompts
    (and ``B`` metadata entries when metadata is given)."""
    if images.ndim not in (4, 5) or images.shape[-3] != 3:
        raise RewardError(
            f"reward images must be [B, 3, H, W] or [B, F, 3, H, W], got shape {tuple(images.shape)}"
        )
    if len(prompts) != images.shape[0]:
        raise RewardError(
            f"reward got {images.shape[0]} images but {len(prompts)} prompts; pass one per image"
        )
    if metadata is not None and len(metadata) != images.shape[0]:
        raise RewardError(
            f"reward got {images.shape[0]} images but {len(metadata)} metadata entries; pass one per image"
        )


def flatten_frames(images: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Fold video frames into the batch.

    Args:
        images: ``[B, 3, H, W]`` or ``[B, F, 3, H, W]``.

    Returns:
        (frames ``[B*F, 3, H, W]``, F) with F = 1 for images; sample b owns rows
        ``b*F .. b*F+F-1``.
    """
    if images.ndim == 5:
        b, f = images.shape[:2]
        return images.reshape(b * f, *images.shape[2:]), f
    return images, 1


def mean_over_frames(frame_scores: torch.Tensor, frames: int) -> torch.Tensor:
    """Per-frame scores ``[B*F]`` -> per-sample mean ``[B]`` (NaN in any frame gives NaN)."""
    return frame_scores.reshape(-1, frames).mean(dim=1)


def finite_rows(images: torch.Tensor) -> torch.Tensor:
    """``[N, ...]`` -> bool ``[N]``: True where every value of the row is finite."""
    return torch.isfinite(images.reshape(images.shape[0], -1)).all(dim=1)


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """``[N, 3, H, W]`` float in ``[0, 1]`` -> uint8 ``[N, H, W, 3]`` (round, clamp; NaN -> 0).

    The same quantisation Flow-GRPO applies before PIL: ``round(x * 255)`` clamped to 0..255.
    """
    x = torch.nan_to_num(images.detach().float().cpu(), nan=0.0)
    x = (x * 255).round().clamp(0, 255).to(torch.uint8)
    return x.permute(0, 2, 3, 1).contiguous().numpy()


def filter_finite(scores: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Which samples have a usable score.

    Args:
        scores: ``[B]`` reward scores, possibly with NaN/inf for failed samples.

    Returns:
        (mask bool ``[B]``, True where the score is finite; number of samples dropped). Logs a
        warning naming the dropped indices when any are dropped.
    """
    mask = torch.isfinite(scores)
    n_dropped = int((~mask).sum())
    if n_dropped:
        bad = torch.nonzero(~mask).flatten().tolist()
        shown = ", ".join(str(i) for i in bad[:10]) + (", ..." if len(bad) > 10 else "")
        log.warning(
            "dropping %d of %d samples with a non-finite reward (indices %s)", n_dropped, len(mask), shown
        )
    return mask, n_dropped


class FrameReward(Reward):
    """A reward that scores images one frame at a time, in batches, as uint8 pixels.

    Subclasses implement :meth:`score_frames`. ``__call__`` folds video frames into the batch
    (each frame keeps its sample's prompt and metadata), quantises pixels as Flow-GRPO does
    (:func:`to_uint8`), scores the frames with finite pixels in chunks of ``batch_size``, gives
    NaN to a frame with a non-finite pixel, and returns the mean over each sample's frames (a
    NaN frame makes the sample NaN).
    """

    batch_size: int = 32

    @abstractmethod
    def score_frames(self, pixels: np.ndarray, prompts: list[str], metadata: Metadata | None) -> torch.Tensor:
        """Score at most ``batch_size`` frames.

        Args:
            pixels: uint8 ``[N, H, W, 3]`` RGB.
            prompts: ``N`` prompts (a frame's sample's prompt).
            metadata: ``N`` metadata dicts, or None.

        Returns:
            float32 ``[N]``.
        """

    def __call__(
        self, images: torch.Tensor, prompts: list[str], metadata: Metadata | None = None
    ) -> torch.Tensor:
        check_batch(images, prompts, metadata)
        frames, n = flatten_frames(images)
        ok = torch.nonzero(finite_rows(frames)).flatten().tolist()
        pixels = to_uint8(frames)
        scores = torch.full((frames.shape[0],), float("nan"), dtype=torch.float32)
        for start in range(0, len(ok), self.batch_size):
            rows = ok[start : start + self.batch_size]
            meta = None if metadata is None else [metadata[r // n] for r in rows]
            got = self.score_frames(pixels[rows], [prompts[r // n] for r in rows], meta)
            scores[rows] = got.detach().float().cpu().reshape(len(rows))
        return mean_over_frames(scores, n)
