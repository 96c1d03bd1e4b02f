"""``pickscore``: PickScore (Kirstain et al. 2023), a CLIP-H fine-tuned on Pick-a-Pic preferences.

Score of an image ``x`` for prompt ``p``: ``exp(logit_scale) * cos(E_img(x), E_txt(p))``, the
logit PickScore defines (``logit_scale`` is the model's own; about 100 for PickScore_v1, so
scores sit around 18-24). ``divisor`` divides it: Flow-GRPO's ``flow_grpo/pickscore_scorer.py``
(``PickScoreScorer.__call__``) divides by 26 to bring it near ``[0, 1]``; pass
``divisor: 26`` to train on the same scale.

Weights: ``yuvalkirstain/PickScore_v1`` (model) with the processor of
``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``, as Flow-GRPO loads them, from a local folder or the
Hugging Face cache (never downloaded). Video: every frame is scored, the sample gets the
mean over its frames (:class:`~digen.rewards.base.FrameReward`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from digen.rewards.base import FrameReward, Metadata
from digen.rewards.pretrained import clip_cosine, load_clip
from digen.rewards.registry import register


@register("pickscore")
class PickScore(FrameReward):
    """PickScore of each (image, prompt) pair.

    Args:
        model: folder or cached repo id of the PickScore CLIP weights.
        processor: folder or cached repo id of its processor (CLIP-H tokenizer + image processor).
        divisor: the score is divided by this (26: Flow-GRPO's scale).
        batch_size: frames per forward pass.
        device: where the model runs (default: the worker's device).
    """

    name = "pickscore"

    def __init__(
        self,
        model: str | Path = "yuvalkirstain/PickScore_v1",
        processor: str | Path | None = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K",
        divisor: float = 1.0,
        batch_size: int = 32,
        device: str = "cpu",
    ):
        self.device, self.divisor, self.batch_size = device, float(divisor), int(batch_size)
        self.clip, self.processor = load_clip(model, processor, reward=self.name, device=device)

    @torch.no_grad()
    def score_frames(self, pixels: np.ndarray, prompts: list[str], metadata: Metadata | None) -> torch.Tensor:
        cosine = clip_cosine(self.clip, self.processor, pixels, prompts, self.device)
        return (self.clip.logit_scale.exp() * cosine).float().cpu() / self.divisor
