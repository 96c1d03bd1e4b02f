"""What every diffusers-backed :class:`FlowPolicy` shares: loading, freezing, LoRA.

A family adapter (``sd3.py``, ``flux.py``, ...) subclasses :class:`PipelinePolicy` and fills in
the model-specific parts: latent layout, sigma schedule, prompt encoding, decoding, and the
hooks of :meth:`FlowPolicy.velocity` where its pipeline differs (timestep convention,
transformer keyword arguments, CFG combination). The pipeline object itself is kept (``self.pipe``) for its tokenizers, text encoders,
VAE, scheduler and its ``encode_prompt``/latent helpers; its ``__call__`` is never used.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import torch

from digen.errors import ConfigError, ModelError
from digen.models import lora
from digen.models.base import FlowPolicy, PromptEmbeds


def read_model_index(path: str | Path) -> dict[str, Any]:
    """``model_index.json`` of a pipeline folder; ``ModelError`` (with the fix) when absent."""
    folder = Path(path)
    fix = f"make one with digen make-tiny-model {folder} --arch sd3"
    if not folder.is_dir():
        raise ModelError(f"model.path {folder} does not exist or is not a folder; {fix}")
    index = folder / "model_index.json"
    if not index.is_file():
        raise ModelError(
            f"model.path {folder} is not a diffusers pipeline folder (no model_index.json); {fix}"
        )
    try:
        data = json.loads(index.read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"model.path {folder}: cannot read model_index.json ({e})") from e
    if not isinstance(data, dict) or "_class_name" not in data:
        raise ModelError(
            f"model.path {folder}: model_index.json has no _class_name; is it a diffusers pipeline?"
        )
    return data


def load_pipeline(
    path: str | Path,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    text_encoder_dtype: torch.dtype | None = None,
    vae_dtype: torch.dtype = torch.float32,
):
    """The pipeline named in ``model_index.json``, loaded from the local folder only, as one
    loads SD3.5/FLUX.1 from disk: the transformer in ``dtype``, the VAE in ``vae_dtype``, the
    text encoders (and any other component) in ``text_encoder_dtype`` (None: ``dtype``),
    text encoders and VAE frozen in eval mode, all on ``device``."""
    import diffusers

    class_name = read_model_index(path)["_class_name"]
    pipeline_cls = getattr(diffusers, class_name, None)
    if pipeline_cls is None:
        raise ModelError(f"model.path {path}: diffusers {diffusers.__version__} has no pipeline {class_name}")
    dtypes = {"default": text_encoder_dtype or dtype, "transformer": dtype, "vae": vae_dtype}
    diffusers.utils.logging.disable_progress_bar()  # a quiet load; digen shows its own progress
    try:
        pipe = pipeline_cls.from_pretrained(str(path), **{_dtype_kwarg(): dtypes}, local_files_only=True)
    except (OSError, ValueError, TypeError) as e:
        raise ModelError(f"model.path {path}: cannot load {class_name} ({e})") from e
    pipe.set_progress_bar_config(disable=True)
    for name, component in pipe.components.items():
        if isinstance(component, torch.nn.Module) and name != "transformer":
            component.requires_grad_(False).eval()
    pipe.transformer.eval()
    return pipe.to(device)


def _dtype_kwarg() -> str:
    """``dtype`` on diffusers versions that renamed ``torch_dtype`` (and warn on the old name)."""
    from diffusers.utils import deprecation_utils

    return "dtype" if hasattr(deprecation_utils, "_resolve_dtype") else "torch_dtype"


class PipelinePolicy(FlowPolicy):
    """A :class:`FlowPolicy` over a loaded diffusers pipeline (see the module docstring).

    Subclasses set ``family``, ``default_lora_targets`` and ``default_max_sequence_length``
    and implement the model-specific methods of :class:`FlowPolicy`.
    """

    default_lora_targets: ClassVar[tuple[str, ...]] = lora.SD3_TARGETS
    default_max_sequence_length: ClassVar[int] = 256

    def __init__(
        self,
        pipe,
        *,
        height: int,
        width: int,
        max_sequence_length: int | None = None,
        num_frames: int | None = None,
    ):
        self.pipe = pipe
        self.transformer = pipe.transformer
        self.config: Any = pipe.transformer.config  # the transformer's diffusers config
        self.device = pipe.transformer.device
        self.dtype = pipe.transformer.dtype
        self.height, self.width = height, width
        self.max_sequence_length = max_sequence_length or self._default_sequence_length()
        if num_frames is not None and not self.is_video:
            raise ConfigError(
                f"num_frames ({num_frames}) is only for video models; {self.family} makes images"
            )

    def _default_sequence_length(self) -> int:
        """The family's usual T5 length, capped by the T5 tokenizer's ``model_max_length``
        (the tiny models declare 32)."""
        limits = [self.default_max_sequence_length]
        for name in ("tokenizer_3", "tokenizer_2"):
            tok = getattr(self.pipe, name, None)
            if tok is not None and "T5" in type(tok).__name__:
                limits.append(int(tok.model_max_length))
        return min(limits)

    def _check_multiple(self, multiple: int, why: str) -> None:
        for field, value in (("height", self.height), ("width", self.width)):
            if value <= 0 or value % multiple:
                raise ConfigError(
                    f"{field} ({value}) must be a positive multiple of {multiple} for {self.family} ({why})"
                )

    @property
    def guidance_embeds(self) -> bool:
        """The transformer config's ``guidance_embeds`` (FLUX.1-dev, HunyuanVideo: True)."""
        return bool(self.config.get("guidance_embeds", False))

    # --- prompts --------------------------------------------------------------------
    negative_prompt: ClassVar[str] = ""
    """What the unconditional CFG branch encodes: the empty prompt (Qwen-Image: ``" "``)."""

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], *, with_uncond: bool) -> PromptEmbeds:
        """:meth:`_encode` of ``prompts``; ``uncond``: of :attr:`negative_prompt`, once per row,
        when ``with_uncond``. (SD3 and Wan instead have their pipeline's ``encode_prompt``
        encode both at once.)"""
        tensors = self._encode(list(prompts))
        uncond = self._encode([self.negative_prompt] * len(prompts)) if with_uncond else {}
        return PromptEmbeds(tensors, uncond)

    def _encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """The transformer's prompt tensors for ``prompts`` (one row each), keyed by the
        argument they feed, via the pipeline's ``encode_prompt``."""
        raise NotImplementedError

    # --- trained parameters ---------------------------------------------------------
    def enable_lora(
        self, rank: int, alpha: int, target_modules: list[str] | None = None, dtype: torch.dtype | None = None
    ) -> None:
        lora.add_lora(
            self.transformer,
            rank=rank,
            alpha=alpha,
            target_modules=target_modules or self.default_lora_targets,
            dtype=dtype,
        )

    @property
    def has_lora(self) -> bool:
        return lora.has_lora(self.transformer)

    def trainable_names(self) -> list[str]:
        if self.has_lora:
            return lora.lora_names(self.transformer)
        return lora.full_names(self.transformer)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        if self.has_lora:
            return lora.lora_state_dict(self.transformer)
        return lora.full_state_dict(self.transformer)

    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if self.has_lora:
            lora.load_lora_state_dict(self.transformer, state)
        else:
            lora.load_full_state_dict(self.transformer, state)

    @contextmanager
    def reference_mode(self) -> Iterator[None]:
        with lora.lora_disabled(self.transformer):
            yield

    def save_pretrained_transformer(self, out_dir: str | Path) -> None:
        """Write the transformer as a diffusers model folder (LoRA merged into a copy first,
        so the folder loads without peft)."""
        import copy

        model: Any = copy.deepcopy(self.transformer)
        if lora.has_lora(model):
            model.fuse_lora()
            model.unload_lora()
        model.save_pretrained(str(out_dir))
