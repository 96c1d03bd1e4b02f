"""``imagereward``: ImageReward (Xu et al. 2023), a BLIP image-text encoder with an MLP head
trained on human preference rankings.

Score: ``(MLP(f) - mean) / std`` with ``f`` the ``[CLS]`` feature of BLIP's BERT text encoder
run on the prompt with cross-attention to the ViT-L/16 image tokens, ``mean =
0.16717362830052426`` and ``std = 1.0333394966054072`` (the constants of ImageReward's
``ImageReward/ImageReward.py``, ``ImageReward.score`` / ``inference_rank``; about -2 to 2).
Flow-GRPO's ``flow_grpo/imagereward_scorer.py`` (``ImageRewardScorer.__call__``) scores each
(prompt, image) pair that way; here the pairs go through in batches (same numbers: padding to
35 tokens makes every prompt the same length, and the attention never mixes samples).

Inputs as ImageReward prepares them: the image resized (shorter side to the ViT's 224,
bicubic), centre-cropped, scaled to ``[0, 1]`` and normalised with CLIP's mean/std (its
``_transform``, torchvision on a PIL image, which :func:`preprocess` reproduces with PIL
alone); the prompt tokenised with the ``bert-base-uncased`` tokenizer plus BLIP's added
``[DEC]`` and ``[ENC]`` tokens (BLIP ``init_tokenizer``), padded to ``max_length`` 35,
truncated. ``score`` keeps ``[CLS]`` as the first token (it does not put ``[ENC]`` there, as
BLIP's own image-text matching does), and so does digen.

Weights: ``THUDM/ImageReward``'s ``ImageReward.pt`` (a state dict, read with ``weights_only``:
no code in it runs) and ``med_config.json`` (the text encoder's BERT config), plus the
``bert-base-uncased`` tokenizer folder (``vocab.txt``, ``tokenizer_config.json``); all local
or in the Hugging Face cache, never downloaded.

Why digen's own loader and not the ``image-reward`` package: that package pins
``timm==0.6.13`` and ``fairscale==0.4.13``, installs OpenAI's ``clip`` from a GitHub zip (not
on PyPI), pulls ``diffusers``/``datasets``/``accelerate`` versions of
its own, downloads weights in ``load`` and reads them with ``torch.load`` without
``weights_only``; its ``med.py`` imports helpers from ``transformers.modeling_utils`` that
transformers 5 no longer has, and timm 0.6.13 imports ``torchvision``. The network is BLIP,
which transformers already ships: the checkpoint's ViT
is loaded into ``BlipVisionModel`` (timm's names renamed, :func:`vision_weights`; the fused
``qkv`` stays fused) and its BERT into ``BlipTextModel``, transformers' port of BLIP's
``med.py`` with the same parameter names and a cross-attention in every layer whose keys and
values come from the image width. The MLP is LAION's aesthetic head
(:class:`~digen.rewards.aesthetic.AestheticMLP`), which ImageReward's ``MLP`` is.

Checked against the ``image-reward`` package (1.5) itself: ``scripts/check_imagereward_package.py``
builds the package's own network (``vit.py`` ``VisionTransformer``, ``med.py`` ``BertModel``,
``blip.py`` ``init_tokenizer``, ``ImageReward.py`` ``MLP``/``_transform``) at tiny sizes with
random weights, saves its ``state_dict`` as ``ImageReward.pt`` and scores five PNG images of
five sizes (crops with odd offsets; one prompt truncated at 35 tokens) with
``ImageReward.score`` and ``inference_rank``; this loader on the same files gives the same
token ids and scores within 3.8e-5 absolute on scores of 49 to 56 (6.8e-7 relative, float32
rounding), measured with ``PYTHONPATH=$PWD python scripts/check_imagereward_package.py --pkgs
/tmp/irpkgs --tf4 /tmp/irtf4`` (set-up in the script). The real-size ``ImageReward(med_config)``
the package builds (ViT-L/16 at 224: width 1024, 24 blocks, 16 heads, LayerNorm eps 1e-6) has
446,665,953 parameters; digen's build of the same shapes has 446,206,689, the difference being
exactly BLIP's ``vision_proj`` and ``text_proj`` (459,264), which the score never reads. One
difference kept on purpose: the package loads with ``strict=False`` (a missing weight stays at
its random init); digen refuses a checkpoint that lacks one.

Video: mean over frames (:class:`~digen.rewards.base.FrameReward`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import nn

from digen.errors import ConfigError
from digen.rewards.aesthetic import AestheticMLP
from digen.rewards.base import FrameReward, Metadata
from digen.rewards.pretrained import load_state_dict, locate, locate_file
from digen.rewards.registry import register

MEAN, STD = 0.16717362830052426, 1.0333394966054072
"""ImageReward's normalisation of the MLP output (``ImageReward.__init__``)."""
MAX_LENGTH = 35
"""Prompt length in tokens, padded and truncated (``ImageReward.score``)."""
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
HEAD_WIDTH = 64
"""Width of one ViT attention head: BLIP's ``create_vit`` uses 12 heads for 768 (base) and 16
for 1024 (large); the checkpoint holds no head count."""

_VIT_TOP = {
    "cls_token": "embeddings.class_embedding",
    "pos_embed": "embeddings.position_embedding",
    "patch_embed.proj.weight": "embeddings.patch_embedding.weight",
    "patch_embed.proj.bias": "embeddings.patch_embedding.bias",
    "norm.weight": "post_layernorm.weight",
    "norm.bias": "post_layernorm.bias",
}
_VIT_BLOCK = {
    "norm1": "layer_norm1",
    "norm2": "layer_norm2",
    "attn.qkv": "self_attn.qkv",
    "attn.proj": "self_attn.projection",
    "mlp.fc1": "mlp.fc1",
    "mlp.fc2": "mlp.fc2",
}
_PREFIXES = {"vision": "blip.visual_encoder.", "text": "blip.text_encoder.", "head": "mlp."}


def split_checkpoint(state: dict[str, torch.Tensor], where: str | Path) -> dict[str, dict[str, torch.Tensor]]:
    """``ImageReward.pt`` -> ``{"vision", "text", "head"}`` state dicts, prefixes removed.

    Keys outside the three parts the score uses (BLIP's ``vision_proj``/``text_proj``) and
    ``position_ids`` buffers are left out, as ``ImageReward``'s non-strict load ignores them.

    Raises:
        ConfigError: a part is absent (not an ImageReward checkpoint).
    """
    parts: dict[str, dict[str, torch.Tensor]] = {name: {} for name in _PREFIXES}
    for key, value in state.items():
        key = key.removeprefix("module.")
        for name, prefix in _PREFIXES.items():
            if key.startswith(prefix) and not key.endswith("position_ids"):
                parts[name][key.removeprefix(prefix)] = value
    empty = [f"{_PREFIXES[name]}*" for name, part in parts.items() if not part]
    if empty:
        raise ConfigError(
            f"reward 'imagereward': checkpoint {str(where)!r} has no {', '.join(empty)} weights; "
            "pass THUDM/ImageReward's ImageReward.pt as kwargs.checkpoint"
        )
    return parts


def vision_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """BLIP's timm-style ViT state dict -> ``BlipVisionModel`` names.

    Raises:
        ConfigError: a key that has no counterpart.
    """
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key in _VIT_TOP:
            out[_VIT_TOP[key]] = value
            continue
        index, _, rest = key.removeprefix("blocks.").partition(".")
        module, _, kind = rest.rpartition(".")
        if not key.startswith("blocks.") or module not in _VIT_BLOCK:
            raise ConfigError(
                f"reward 'imagereward': checkpoint key 'blip.visual_encoder.{key}' is not a BLIP ViT's"
            )
        out[f"encoder.layers.{index}.{_VIT_BLOCK[module]}.{kind}"] = value
    return out


def vision_config(state: dict[str, torch.Tensor]) -> Any:
    """The ``BlipVisionConfig`` of BLIP's ViT, read off the weights' shapes (BLIP's
    ``VisionTransformer``: LayerNorm eps 1e-6, exact GELU, MLP ratio from ``fc1``)."""
    from transformers import BlipVisionConfig

    needed = ("patch_embed.proj.weight", "pos_embed", "blocks.0.mlp.fc1.weight")
    absent = [f"blip.visual_encoder.{k}" for k in needed if k not in state]
    if absent:
        raise ConfigError(f"reward 'imagereward': checkpoint lacks {absent}; it is not an ImageReward ViT")
    width, _, patch, _ = state["patch_embed.proj.weight"].shape
    grid = math.isqrt(state["pos_embed"].shape[1] - 1)
    depth = 1 + max(int(k.split(".")[1]) for k in state if k.startswith("blocks."))
    return BlipVisionConfig(
        hidden_size=width,
        intermediate_size=state["blocks.0.mlp.fc1.weight"].shape[0],
        num_hidden_layers=depth,
        num_attention_heads=max(1, width // HEAD_WIDTH),
        image_size=grid * patch,
        patch_size=patch,
        hidden_act="gelu",
        layer_norm_eps=1e-6,
    )


def text_config(med_config: Path, encoder_width: int) -> Any:
    """The ``BlipTextConfig`` of ``med_config.json`` (BLIP's BERT config); its
    ``encoder_width`` is the ViT's, as ``BLIP_Pretrain`` sets it."""
    from transformers import BlipTextConfig

    try:
        med = json.loads(med_config.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"reward 'imagereward': med_config {str(med_config)!r} is not a JSON file ({exc})"
        ) from None
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in keys if k not in med]
    if missing:
        raise ConfigError(f"reward 'imagereward': med_config {str(med_config)!r} lacks {missing}")
    return BlipTextConfig(
        **{k: med[k] for k in keys},
        max_position_embeddings=med.get("max_position_embeddings", 512),
        hidden_act=med.get("hidden_act", "gelu"),
        layer_norm_eps=med.get("layer_norm_eps", 1e-12),
        pad_token_id=med.get("pad_token_id", 0),
        bos_token_id=None,
        eos_token_id=None,
        sep_token_id=None,
        encoder_hidden_size=encoder_width,
        is_decoder=True,  # builds the cross-attention layers; forward runs with is_decoder=False
    )


class ImageRewardModel(nn.Module):
    """BLIP ViT + BERT with cross-attention + MLP head: ``(pixels, ids, mask) -> [N]`` raw MLP
    outputs (before ImageReward's normalisation)."""

    def __init__(self, vision: nn.Module, text: nn.Module, head: nn.Module):
        super().__init__()
        self.vision, self.text, self.head = vision, text, head

    def features(
        self, pixel_values: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        """The ``[CLS]`` features ``[N, hidden]``: pixels ``[N, 3, S, S]``, tokens ``[N, 35]``."""
        image = self.vision(pixel_values=pixel_values).last_hidden_state  # [N, 1 + P, W]
        out = self.text(
            input_ids=input_ids,
            attention_mask=attention_mask,
            encoder_hidden_states=image,
            encoder_attention_mask=torch.ones(image.shape[:2], dtype=torch.long, device=image.device),
            is_decoder=False,
        )
        return out.last_hidden_state[:, 0, :].float()

    def forward(self, pixel_values: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        return self.head(self.features(pixel_values, input_ids, attention_mask)).squeeze(-1)


def load_imagereward(checkpoint: Path, med_config: Path) -> ImageRewardModel:
    """An :class:`ImageRewardModel` (float32, eval, CPU) holding ``checkpoint``'s weights.

    Raises:
        ConfigError: the checkpoint is not an ImageReward one or does not fit ``med_config``.
    """
    return build_imagereward(load_state_dict(checkpoint), med_config, str(checkpoint)).float().eval()


def build_imagereward(state: dict[str, torch.Tensor], med_config: Path, where: str) -> ImageRewardModel:
    """An :class:`ImageRewardModel` holding the weights of ImageReward state dict ``state``
    (``where`` names it in errors); built on the current default device (``meta`` too).

    Raises:
        ConfigError: ``state`` is not an ImageReward one or does not fit ``med_config``.
    """
    from transformers import BlipVisionModel
    from transformers.models.blip.modeling_blip_text import BlipTextModel

    parts = split_checkpoint(state, where)
    vcfg = vision_config(parts["vision"])
    model = ImageRewardModel(
        BlipVisionModel(vcfg),
        BlipTextModel(text_config(med_config, vcfg.hidden_size), add_pooling_layer=False),
        AestheticMLP(int(parts["head"]["layers.0.weight"].shape[1])),
    )
    for name, module, weights in (
        ("vision", model.vision, vision_weights(parts["vision"])),
        ("text", model.text, parts["text"]),
        ("head", model.head, parts["head"]),
    ):
        _load_part(name, module, weights, f"{where!r} (med_config {str(med_config)!r})")
    return model


def _load_part(name: str, module: nn.Module, weights: dict[str, torch.Tensor], where: str) -> None:
    try:
        missing, unexpected = module.load_state_dict(weights, strict=False)
    except RuntimeError as exc:  # a shape mismatch
        missing, unexpected = [str(exc).splitlines()[1].strip()], []
    if missing or unexpected:
        raise ConfigError(
            f"reward 'imagereward': the {name} weights of {where} do not fit "
            f"(missing {list(missing)[:3]}, unexpected {list(unexpected)[:3]})"
        )


def load_tokenizer(folder: Path) -> Any:
    """``bert-base-uncased``'s tokenizer with BLIP's ``[DEC]`` (bos) and ``[ENC]`` tokens added
    (BLIP ``init_tokenizer``; ids ``len(vocab)`` and ``len(vocab) + 1``)."""
    from transformers import BertTokenizer

    tokenizer = BertTokenizer.from_pretrained(str(folder), local_files_only=True)
    tokenizer.add_special_tokens({"bos_token": "[DEC]", "additional_special_tokens": ["[ENC]"]})
    return tokenizer


def preprocess(pixels: np.ndarray, size: int) -> torch.Tensor:
    """uint8 ``[N, H, W, 3]`` -> float32 ``[N, 3, size, size]`` as ImageReward's ``_transform``
    (torchvision on a PIL image): shorter side to ``size`` (longer ``int(size * long / short)``)
    with PIL bicubic, centre crop (offsets ``round((dim - size) / 2)``), ``/255``, CLIP mean/std."""
    out = np.empty((len(pixels), size, size, 3), dtype=np.float32)
    for i, frame in enumerate(pixels):
        image = Image.fromarray(frame)
        w, h = image.size
        short, long = min(w, h), max(w, h)
        resized = (size, int(size * long / short))
        image = image.resize(resized if w <= h else resized[::-1], Image.Resampling.BICUBIC)
        left, top = round((image.size[0] - size) / 2), round((image.size[1] - size) / 2)
        out[i] = np.asarray(image.crop((left, top, left + size, top + size)), dtype=np.float32) / 255.0
    x = (torch.from_numpy(out) - torch.tensor(CLIP_MEAN)) / torch.tensor(CLIP_STD)
    return x.permute(0, 3, 1, 2).contiguous()


@register("imagereward")
class ImageRewardScore(FrameReward):
    """ImageReward score ``(MLP(f) - mean) / std`` of each (image, prompt) pair.

    Args:
        checkpoint: ``ImageReward.pt``, a path or ``repo_id/filename`` in the HF cache.
        med_config: ``med_config.json`` (BLIP's BERT config), a path or ``repo_id/filename``.
        tokenizer: folder or cached repo id of the ``bert-base-uncased`` tokenizer.
        batch_size: frames per forward pass.
        device: where the model runs (default: the worker's device).
    """

    name = "imagereward"

    def __init__(
        self,
        checkpoint: str | Path = "THUDM/ImageReward/ImageReward.pt",
        med_config: str | Path = "THUDM/ImageReward/med_config.json",
        tokenizer: str | Path = "google-bert/bert-base-uncased",
        batch_size: int = 32,
        device: str = "cpu",
    ):
        self.device, self.batch_size = device, int(batch_size)
        path = locate_file(checkpoint, reward=self.name, what="checkpoint")
        config = locate_file(med_config, reward=self.name, what="med_config")
        self.tokenizer = load_tokenizer(locate(tokenizer, reward=self.name, what="tokenizer"))
        self.model = load_imagereward(path, config).to(device)
        self.image_size = int(self.model.vision.config.image_size)

    @torch.no_grad()
    def score_frames(self, pixels: np.ndarray, prompts: list[str], metadata: Metadata | None) -> torch.Tensor:
        text = self.tokenizer(
            list(prompts), padding="max_length", truncation=True, max_length=MAX_LENGTH, return_tensors="pt"
        )
        raw = self.model(
            preprocess(pixels, self.image_size).to(self.device),
            text["input_ids"].to(self.device),
            text["attention_mask"].to(self.device),
        )
        return ((raw - MEAN) / STD).float().cpu()
