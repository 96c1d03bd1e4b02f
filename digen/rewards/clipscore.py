"""``clipscore``: text-image CLIP similarity, on Flow-GRPO's scale.

Score: ``exp(logit_scale) * cos(E_img(x), E_txt(p)) / 100``, i.e. ``logits_per_image / 100``
as Flow-GRPO's ``flow_grpo/clip_scorer.py`` (``ClipScorer.__call__``) reports it. With
OpenAI's CLIP (``logit_scale`` = ln 100) this is exactly the cosine, in ``[-1, 1]``; the
"CLIPScore x 100" of torchmetrics is 100 times it.

Weights: ``openai/clip-vit-large-patch14`` (Flow-GRPO's), from a local folder or the Hugging
Face cache. Video: mean over frames (:class:`~digen.rewards.base.FrameReward`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from digen.rewards.base import FrameReward, Metadata
from digen.rewards.pretrained import clip_cosine, load_clip
from digen.rewards.registry import register


@register("clipscore")
class ClipScore(FrameReward):
    """CLIP similarity of each (image, prompt) pair, ``logits_per_image / 100``.

    Args:
        model: folder or cached repo id of a CLIP model (``CLIPModel`` layout).
        processor: its processor; None: the model's folder.
        batch_size: frames per forward pass.
        device: where the model runs (default: the worker's device).
    """

    name = "clipscore"

    def __init__(
        self,
        model: str | Path = "openai/clip-vit-large-patch14",
        processor: str | Path | None = None,
        batch_size: int = 32,
        device: str = "cpu",
    ):
        self.device, self.batch_size = device, int(batch_size)
        self.clip, self.processor = load_clip(model, processor, reward=self.name, device=device)

    @torch.no_grad()
    def score_frames(self, pixels: np.ndarray, prompts: list[str], metadata: Metadata | None) -> torch.Tensor:
        cosine = clip_cosine(self.clip, self.processor, pixels, prompts, self.device)
        return (self.clip.logit_scale.exp() * cosine / 100).float().cpu()
