"""``hpsv2``: Human Preference Score v2 / v2.1 (Wu et al. 2023), an open_clip ViT-H-14 fine-tuned
on human preferences.

Score: ``cos(E_img(x), E_txt(p))``, the diagonal of ``image_features @ text_features.T`` with
open_clip's normalised features and no logit scale, as Flow-GRPO's
``flow_grpo/hpsv2_scorer.py`` (``HPSv2RewardInferencer.reward``) and DanceGRPO's HPS reward
compute it (about 0.2-0.35 for real images).

Weights: the HPS checkpoint (``HPS_v2.1_compressed.pt`` or ``HPS_v2_compressed.pt`` of
``xswu/HPSv2``: an open_clip state dict, read with ``weights_only``, no code runs) plus the
``laion/CLIP-ViT-H-14-laion2B-s32B-b79K`` folder for the architecture (``config.json``),
tokenizer and image preprocessing; both local or in the Hugging Face cache, never downloaded.
digen loads the open_clip weights into a transformers ``CLIPModel`` (:func:`open_clip_to_transformers`:
the same network, renamed; open_clip's fused ``in_proj`` split into q/k/v), so the reward
needs no open_clip install. The image preprocessing is CLIP's (resize, centre crop,
normalise), which HPS's validation transform also is. Video: mean over frames.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from digen.errors import ConfigError
from digen.rewards.base import FrameReward, Metadata
from digen.rewards.pretrained import clip_cosine, load_state_dict, locate, locate_file
from digen.rewards.registry import register

_BLOCK = {
    "ln_1": "layer_norm1",
    "ln_2": "layer_norm2",
    "attn.out_proj": "self_attn.out_proj",
    "mlp.c_fc": "mlp.fc1",
    "mlp.c_proj": "mlp.fc2",
}
_TOP = {
    "visual.conv1.weight": "vision_model.embeddings.patch_embedding.weight",
    "visual.class_embedding": "vision_model.embeddings.class_embedding",
    "visual.positional_embedding": "vision_model.embeddings.position_embedding.weight",
    "visual.ln_pre.weight": "vision_model.pre_layrnorm.weight",
    "visual.ln_pre.bias": "vision_model.pre_layrnorm.bias",
    "visual.ln_post.weight": "vision_model.post_layernorm.weight",
    "visual.ln_post.bias": "vision_model.post_layernorm.bias",
    "token_embedding.weight": "text_model.embeddings.token_embedding.weight",
    "positional_embedding": "text_model.embeddings.position_embedding.weight",
    "ln_final.weight": "text_model.final_layer_norm.weight",
    "ln_final.bias": "text_model.final_layer_norm.bias",
    "logit_scale": "logit_scale",
}
_PROJECTIONS = {"visual.proj": "visual_projection.weight", "text_projection": "text_projection.weight"}


def open_clip_to_transformers(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An open_clip CLIP state dict -> the same weights under transformers ``CLIPModel`` names.

    Raises:
        ConfigError: a key that has no counterpart (not an open_clip CLIP checkpoint).
    """
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        key = key.removeprefix("module.")
        if key in _TOP:
            out[_TOP[key]] = value
        elif key in _PROJECTIONS:
            out[_PROJECTIONS[key]] = value.T.contiguous()  # open_clip: x @ proj; torch Linear: x @ W.T
        elif ".transformer.resblocks." in f".{key}":
            out.update(_block(key, value))
        elif key == "attn_mask":
            continue  # open_clip's causal mask buffer; CLIPModel builds its own
        else:
            raise ConfigError(f"hpsv2: checkpoint key {key!r} is not part of an open_clip CLIP model")
    return out


def _block(key: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    tower, rest = key.split("transformer.resblocks.", 1)
    index, name = rest.split(".", 1)
    prefix = f"{'vision_model' if tower == 'visual.' else 'text_model'}.encoder.layers.{index}."
    if name.startswith("attn.in_proj_"):
        kind = name.removeprefix("attn.in_proj_")  # weight | bias: q, k, v stacked on dim 0
        q, k, v = value.chunk(3, dim=0)
        return {f"{prefix}self_attn.{p}_proj.{kind}": t for p, t in zip("qkv", (q, k, v), strict=True)}
    module, _, kind = name.rpartition(".")
    if module not in _BLOCK:
        raise ConfigError(f"hpsv2: checkpoint key {key!r} is not part of an open_clip CLIP model")
    return {f"{prefix}{_BLOCK[module]}.{kind}": value}


def load_hps_clip(checkpoint: Path, processor_dir: Path, device: str):  # -> (CLIPModel, CLIPProcessor)
    """A ``CLIPModel`` shaped by ``processor_dir/config.json`` holding the HPS weights."""
    from transformers import CLIPConfig, CLIPModel, CLIPProcessor

    config = CLIPConfig.from_pretrained(str(processor_dir), local_files_only=True)
    model = CLIPModel(config)
    weights = open_clip_to_transformers(load_state_dict(checkpoint))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not k.endswith("position_ids")]
    if missing or unexpected:
        raise ConfigError(
            f"hpsv2: checkpoint {str(checkpoint)!r} does not fit the CLIP of {str(processor_dir)!r} "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]}); pass the ViT-H-14 folder as kwargs.processor"
        )
    processor = CLIPProcessor.from_pretrained(str(processor_dir), local_files_only=True)
    return model.float().eval().to(device), processor


@register("hpsv2")
class HPSv2(FrameReward):
    """HPSv2 score (cosine of open_clip's normalised features) of each (image, prompt) pair.

    Args:
        checkpoint: the HPS weights, a path or ``repo_id/filename`` in the HF cache
            (v2.1: ``xswu/HPSv2/HPS_v2.1_compressed.pt``; v2.0: ``.../HPS_v2_compressed.pt``).
        processor: folder or cached repo id of ViT-H-14 (config, tokenizer, preprocessing).
        batch_size: frames per forward pass.
        device: where the model runs (default: the worker's device).
    """

    name = "hpsv2"

    def __init__(
        self,
        checkpoint: str | Path = "xswu/HPSv2/HPS_v2.1_compressed.pt",
        processor: str | Path = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K",
        batch_size: int = 32,
        device: str = "cpu",
    ):
        self.device, self.batch_size = device, int(batch_size)
        path = locate_file(checkpoint, reward=self.name, what="checkpoint")
        folder = locate(processor, reward=self.name, what="processor")
        self.clip, self.processor = load_hps_clip(path, folder, device)

    @torch.no_grad()
    def score_frames(self, pixels: np.ndarray, prompts: list[str], metadata: Metadata | None) -> torch.Tensor:
        return clip_cosine(self.clip, self.processor, pixels, prompts, self.device).float().cpu()
