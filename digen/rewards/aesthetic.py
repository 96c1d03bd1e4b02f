"""``aesthetic``: the LAION aesthetic predictor v2, an MLP on CLIP ViT-L/14 image embeddings.

Score: ``MLP(e / |e|)`` with ``e`` the CLIP ViT-L/14 image embedding, L2-normalised as LAION's
``improved-aesthetic-predictor`` (``simple_inference.py``) does and as Flow-GRPO's
``flow_grpo/aesthetic_scorer.py`` (``AestheticScorer.__call__``) does; about 1-10. The MLP
is LAION's: ``Linear(D, 1024), Dropout, Linear(1024, 128), Dropout, Linear(128, 64), Dropout,
Linear(64, 16), Linear(16, 1)`` (dropout off at inference), weights
``sac+logos+ava1-l14-linearMSE.pth`` (a plain state dict, read with ``weights_only``; a
``.safetensors`` file works too). The prompt is not used.

Weights: ``openai/clip-vit-large-patch14`` plus the MLP file, local or in the Hugging Face
cache. Video: mean over frames (:class:`~digen.rewards.base.FrameReward`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from digen.errors import ConfigError
from digen.rewards.base import FrameReward, Metadata
from digen.rewards.pretrained import clip_embeddings, load_clip, load_state_dict, locate_file
from digen.rewards.registry import register


class AestheticMLP(nn.Module):
    """LAION's head: ``[N, dim]`` normalised embeddings -> ``[N, 1]`` scores."""

    def __init__(self, dim: int = 768):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(dim, 1024),
            nn.Dropout(0.2),
            nn.Linear(1024, 128),
            nn.Dropout(0.2),
            nn.Linear(128, 64),
            nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, embed: torch.Tensor) -> torch.Tensor:
        return self.layers(embed)


@register("aesthetic")
class Aesthetic(FrameReward):
    """LAION aesthetic score of each image.

    Args:
        weights: the MLP's state dict (``.pth`` or ``.safetensors``), a path or
            ``repo_id/filename`` in the Hugging Face cache.
        model: folder or cached repo id of CLIP ViT-L/14.
        processor: its processor; None: the model's folder.
        batch_size: frames per forward pass.
        device: where the models run (default: the worker's device).
    """

    name = "aesthetic"

    def __init__(
        self,
        weights: str | Path = "sac+logos+ava1-l14-linearMSE.pth",
        model: str | Path = "openai/clip-vit-large-patch14",
        processor: str | Path | None = None,
        batch_size: int = 32,
        device: str = "cpu",
    ):
        self.device, self.batch_size = device, int(batch_size)
        path = locate_file(weights, reward=self.name, what="weights")
        self.clip, self.processor = load_clip(model, processor, reward=self.name, device=device)
        self.mlp = AestheticMLP(int(self.clip.config.projection_dim))
        try:
            self.mlp.load_state_dict(load_state_dict(path))
        except RuntimeError as exc:
            first = str(exc).splitlines()[0]
            raise ConfigError(
                f"reward 'aesthetic': weights {str(path)!r} are not a LAION aesthetic MLP for "
                f"{self.clip.config.projection_dim}-d CLIP embeddings ({first})"
            ) from None
        self.mlp = self.mlp.eval().to(device)

    @torch.no_grad()
    def score_frames(self, pixels: np.ndarray, prompts: list[str], metadata: Metadata | None) -> torch.Tensor:
        img, _ = clip_embeddings(self.clip, self.processor, pixels, None, self.device)
        return self.mlp(img).squeeze(-1).float().cpu()
