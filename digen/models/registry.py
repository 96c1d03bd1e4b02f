"""Model families: which diffusers pipelines digen drives, with which adapter and tiny builder.

To add a family, write its adapter (a :class:`~digen.models.pipeline_policy.PipelinePolicy`
subclass) and its tiny builder in their own module, then add one :class:`Family` entry to
:data:`FAMILIES`. Adapters and builders are named as ``"module:attr"`` strings and imported on
first use, so ``import digen.models`` does not import diffusers.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from digen.errors import ConfigError, ModelError
from digen.models.base import FlowPolicy

if TYPE_CHECKING:
    from digen.models.pipeline_policy import PipelinePolicy


@dataclass(frozen=True)
class Family:
    """pipelines: the ``model_index.json`` ``_class_name`` values this family loads;
    adapter: ``"module:Class"`` of its FlowPolicy; tiny_builder: ``"module:function"`` with
    signature ``(out_dir: Path, *, seed: int, resolution: int) -> None`` (None: no tiny model)."""

    pipelines: tuple[str, ...]
    adapter: str
    tiny_builder: str | None = None

    def adapter_class(self) -> type[PipelinePolicy]:
        return _resolve(self.adapter)

    def build_tiny(self, out_dir: Path, *, seed: int, resolution: int, **size: int) -> None:
        assert self.tiny_builder is not None
        _resolve(self.tiny_builder)(out_dir, seed=seed, resolution=resolution, **size)


FAMILIES: dict[str, Family] = {  # name: Family(pipelines, "module:Adapter", "module:tiny_builder")
    "sd3": Family(
        ("StableDiffusion3Pipeline",), "digen.models.sd3:Sd3Policy", "digen.models.tiny:build_tiny_sd3"
    ),
    "flux": Family(("FluxPipeline",), "digen.models.flux:FluxPolicy", "digen.models.tiny:build_tiny_flux"),
    "qwen-image": Family(
        ("QwenImagePipeline",),
        "digen.models.qwen_image:QwenImagePolicy",
        "digen.models.qwen_image:build_tiny_qwen_image",
    ),
    "wan": Family(("WanPipeline",), "digen.models.wan:WanPolicy", "digen.models.wan:build_tiny_wan"),
    "hunyuan-video": Family(
        ("HunyuanVideoPipeline",),
        "digen.models.hunyuan_video:HunyuanVideoPolicy",
        "digen.models.hunyuan_video:build_tiny_hunyuan_video",
    ),
}


def _resolve(target: str) -> Any:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def detect_family(path: str | Path) -> str:
    """The family of the pipeline folder ``path`` (from ``model_index.json`` ``_class_name``).
    Raises ``ModelError`` naming the path and the fix when it is not a supported pipeline."""
    from digen.models.pipeline_policy import read_model_index

    class_name = read_model_index(path)["_class_name"]
    for name, family in FAMILIES.items():
        if class_name in family.pipelines:
            return name
    supported = ", ".join(f"{p} ({name})" for name, fam in FAMILIES.items() for p in fam.pipelines)
    raise ModelError(
        f"model.path {path} holds a {class_name}, which digen does not drive; supported pipelines: {supported}"
    )


def load_policy(
    path: str | Path,
    *,
    height: int,
    width: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    num_frames: int | None = None,
    max_sequence_length: int | None = None,
    text_encoder_dtype: torch.dtype | None = None,
    vae_dtype: torch.dtype = torch.float32,
    autocast: torch.dtype | None = None,
) -> FlowPolicy:
    """The :class:`FlowPolicy` for the local diffusers pipeline folder ``path``, generating
    ``height x width`` (``num_frames`` for video families), the transformer in ``dtype``, the
    text encoders in ``text_encoder_dtype`` (None: ``dtype``), the VAE in ``vae_dtype``, on
    ``device``; ``autocast``: every transformer forward under ``torch.autocast`` in that dtype
    (None: none). ``max_sequence_length``: T5 prompt length (None: the family default, capped
    by the tokenizer's ``model_max_length``; a config never relies on the cap:
    :func:`digen.checks.model_problems` refuses a length the text encoder cannot take)."""
    from digen.models.pipeline_policy import load_pipeline

    adapter = FAMILIES[detect_family(path)].adapter_class()
    pipe = load_pipeline(
        path, dtype=dtype, device=device, text_encoder_dtype=text_encoder_dtype, vae_dtype=vae_dtype
    )
    policy = adapter(
        pipe, height=height, width=width, num_frames=num_frames, max_sequence_length=max_sequence_length
    )
    policy.autocast_dtype = autocast
    return policy


def make_tiny_model(
    out_dir: str | Path, arch: str, *, seed: int = 0, resolution: int = 32, **size: int
) -> Path:
    """Write a complete random-weight diffusers pipeline folder of family ``arch`` to
    ``out_dir`` (offline, a few MB, a pure function of ``seed``) and return its path.
    ``size`` (``layers``, ``heads``, ``head_dim``; the sd3 family) makes its transformer larger."""
    buildable = [name for name, fam in FAMILIES.items() if fam.tiny_builder]
    if arch not in buildable:
        raise ConfigError(f"arch ({arch!r}) must be one of {', '.join(buildable)}")
    if size and arch != "sd3":
        raise ConfigError(f"--layers/--heads/--head-dim size only the sd3 family's transformer, not {arch}")
    bad = {k: v for k, v in size.items() if v < 1}
    if bad:
        raise ConfigError(f"transformer size {bad} must be at least 1")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    FAMILIES[arch].build_tiny(out, seed=seed, resolution=resolution, **size)
    return out
