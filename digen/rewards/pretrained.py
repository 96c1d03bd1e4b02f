"""Finding and loading reward models that live on disk: never downloaded at run time.

A model is named by a local folder or by a Hugging Face repo id that is already in the local
cache (``HF_HOME``, ``HF_HUB_CACHE``); lookups run with ``local_files_only=True``. A model that
is in neither place is a one-line :class:`~digen.errors.ConfigError` that names the folder
and the command that fetches it on a machine with network.

Also here: the CLIP pieces the CLIP-based rewards share (``pickscore``, ``clipscore``,
``aesthetic``, ``hpsv2``): :func:`load_clip`, :func:`clip_embeddings` and :func:`clip_cosine`.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import torch

from digen.errors import ConfigError


def require_package(module: str, reward: str, pip: str) -> None:
    """Raise a one-line :class:`ConfigError` unless ``module`` can be imported."""
    if importlib.util.find_spec(module) is None:
        raise ConfigError(
            f"reward '{reward}' needs the Python package '{pip}' ({module} is not installed); "
            f"install it with pip install 'digen[rewards]' or pip install {pip}"
        )


def locate(name: str | Path, *, reward: str, what: str = "model") -> Path:
    """The local folder of ``name``: a folder that exists, else a repo id in the HF cache.

    Raises:
        ConfigError: neither (the message names the folder and how to fetch it).
    """
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if str(name).count("/") == 1 and not path.is_absolute():
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(str(name), local_files_only=True))
        except Exception:  # LocalEntryNotFoundError, HFValidationError, ...
            pass
    raise ConfigError(
        f"reward '{reward}': {what} {str(name)!r} is not a folder nor in the Hugging Face cache "
        f"(digen never downloads weights); fetch it with `huggingface-cli download {name}` on a machine "
        f"with network (or copy the folder here) and pass its path as kwargs.{what}"
    )


def locate_file(name: str | Path, *, reward: str, what: str) -> Path:
    """A weights file: a path that exists, else ``repo_id/filename`` in the HF cache.

    Raises:
        ConfigError: neither (names the file and how to fetch it).
    """
    path = Path(name).expanduser()
    if path.is_file():
        return path
    parts = str(name).split("/")
    if len(parts) >= 3 and not path.is_absolute():
        from huggingface_hub import hf_hub_download

        try:
            return Path(hf_hub_download("/".join(parts[:2]), "/".join(parts[2:]), local_files_only=True))
        except Exception:  # LocalEntryNotFoundError, EntryNotFoundError, ...
            pass
    raise ConfigError(
        f"reward '{reward}': {what} file {str(name)!r} does not exist nor is in the Hugging Face cache "
        f"(digen never downloads weights); fetch it on a machine with network and pass its path as kwargs.{what}"
    )


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Tensors of a ``.safetensors`` file or of a plain PyTorch state dict (``weights_only``:
    no code in the file runs)."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    state = torch.load(str(path), map_location="cpu", weights_only=True)
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    return dict(state)


def load_clip(
    model: str | Path, processor: str | Path | None, *, reward: str, device: str
) -> tuple[Any, Any]:
    """A transformers ``CLIPModel`` (float32, eval, on ``device``) and its ``CLIPProcessor``.

    Args:
        model: folder or cached repo id of the CLIP weights (``save_pretrained`` layout).
        processor: folder or repo id of the processor (tokenizer + image processor); None:
            the model's folder.
    """
    from transformers import CLIPModel, CLIPProcessor

    model_dir = locate(model, reward=reward, what="model")
    proc_dir = model_dir if processor is None else locate(processor, reward=reward, what="processor")
    clip = CLIPModel.from_pretrained(str(model_dir), local_files_only=True, dtype=torch.float32)
    proc = CLIPProcessor.from_pretrained(str(proc_dir), local_files_only=True)
    return clip.eval().to(device), proc


def _embedding(out: Any) -> torch.Tensor:
    """``get_*_features`` output -> ``[N, D]`` (transformers 5 returns a model output whose
    ``pooler_output`` is the projected embedding; older versions return the tensor)."""
    return out if isinstance(out, torch.Tensor) else out.pooler_output


@torch.no_grad()
def clip_embeddings(
    clip: Any, processor: Any, pixels: np.ndarray, prompts: list[str] | None, device: str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """L2-normalised CLIP embeddings.

    Args:
        pixels: uint8 ``[N, H, W, 3]``; preprocessed by the CLIP image processor (resize,
            centre crop, normalise), as PickScore and Flow-GRPO feed PIL images to it.
        prompts: ``N`` texts (padded to the tokenizer's max length, truncated), or None.

    Returns:
        (image ``[N, D]`` float32, text ``[N, D]`` float32 or None).
    """
    image_in = processor(images=list(pixels), return_tensors="pt")
    img = _embedding(clip.get_image_features(pixel_values=image_in["pixel_values"].to(device)))
    img = img / img.norm(dim=-1, keepdim=True)
    if prompts is None:
        return img.float(), None
    text_in = processor(
        text=list(prompts),
        padding="max_length",
        truncation=True,
        max_length=processor.tokenizer.model_max_length,
        return_tensors="pt",
    )
    txt = _embedding(
        clip.get_text_features(
            input_ids=text_in["input_ids"].to(device), attention_mask=text_in["attention_mask"].to(device)
        )
    )
    txt = txt / txt.norm(dim=-1, keepdim=True)
    return img.float(), txt.float()


@torch.no_grad()
def clip_cosine(
    clip: Any, processor: Any, pixels: np.ndarray, prompts: list[str], device: str
) -> torch.Tensor:
    """Cosine similarity of each (image, prompt) pair's CLIP embeddings (:func:`clip_embeddings`),
    float32 ``[N]``: what ``clipscore``, ``pickscore`` (times the logit scale) and ``hpsv2`` score."""
    img, txt = clip_embeddings(clip, processor, pixels, prompts, device)
    assert txt is not None
    return (img * txt).sum(dim=-1)
