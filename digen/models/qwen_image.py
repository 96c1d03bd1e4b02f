"""Qwen-Image (``QwenImagePipeline``) as a :class:`FlowPolicy`, and its tiny builder.

Step space: the packed latent ``[seq = (H/16)(W/16), C*4 = 64]`` (2x2 patches of the 16-channel
``AutoencoderKLQwenImage`` latent, ``QwenImagePipeline._pack_latents``), as FLUX; the transformer
gets the token grid as ``img_shapes`` instead of position ids. It takes ``timestep = sigma`` (the
pipeline divides its timesteps by 1000; the timestep projection multiplies back). Prompts are the
last hidden states of the Qwen2.5-VL text encoder over the pipeline's chat template, template
tokens dropped, with a padding mask (``encoder_hidden_states_mask``); their length is the longest
prompt of the ``encode_prompts`` call, so only rows of one call stack.

Guidance is true CFG with two passes (cond, then the negative prompt ``" "``: Qwen-Image's
empty negative prompt) combined as the pipeline does, with its norm rescale per token:
``comb = u + s (c - u)``, ``v = comb * |c| / |comb|`` (norms over the channel dim).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from digen.models import lora, text
from digen.models.packed import PackedLatentPolicy
from digen.models.tiny import _sub_seed, check_resolution
from digen.models.wan import unnormalize_latents

NEGATIVE_PROMPT = " "
# Qwen-Image's scheduler_config.json: exponential dynamic shift, stretched to end at 0.02.
SCHEDULER_CONFIG: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 0.9,
    "base_image_seq_len": 256,
    "max_image_seq_len": 8192,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
}
QWEN_SPECIAL_TOKENS = (
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)


class QwenImagePolicy(PackedLatentPolicy):
    family = "qwen-image"
    default_lora_targets = lora.QWEN_IMAGE_TARGETS
    default_max_sequence_length = 512  # QwenImagePipeline's default
    negative_prompt = NEGATIVE_PROMPT
    cfg_in_one_forward = False  # two passes: the negative prompt has its own length

    def _encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """``encoder_hidden_states [B, L, D]`` and ``encoder_hidden_states_mask [B, L]`` (1 for
        prompt tokens, 0 for padding) via the pipeline's ``encode_prompt``; ``uncond`` encodes
        the negative prompt ``" "`` (its own length ``L0``)."""
        embeds, mask = self.pipe.encode_prompt(
            prompt=prompts, device=self.device, max_sequence_length=self.max_sequence_length
        )
        if mask is None:  # the pipeline drops an all-ones mask
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return {"encoder_hidden_states": embeds, "encoder_hidden_states_mask": mask}

    def transformer_kwargs(
        self, x: torch.Tensor, tensors: dict[str, torch.Tensor], guidance_scale: float
    ) -> dict[str, Any]:
        """The prompt states in the model dtype, their padding mask as bool (None when nothing
        is padded, as the pipeline passes it) and the token grid ``img_shapes``, one per row."""
        mask = tensors["encoder_hidden_states_mask"].to(self.device).bool()
        h, w = self._grid()
        return {
            "encoder_hidden_states": tensors["encoder_hidden_states"].to(self.device, self.dtype),
            "encoder_hidden_states_mask": None if mask.all() else mask,
            "img_shapes": [[(1, h, w)]] * x.shape[0],
        }

    @staticmethod
    def combine_cfg(cond: torch.Tensor, uncond: torch.Tensor, guidance_scale: float) -> torch.Tensor:
        """Qwen-Image's rescaled CFG (:func:`rescaled_cfg`)."""
        return rescaled_cfg(cond, uncond, guidance_scale)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Packed latents ``[B, seq, C*4]`` -> images ``[B, 3, H, W]`` float32 in [0, 1]."""
        vae = self.pipe.vae
        z = unnormalize_latents(self.unpack(latents).to(vae.device, vae.dtype), vae)  # [B, C, 1, h, w]
        image = vae.decode(z, return_dict=False)[0][:, :, 0]
        return (image.float() / 2 + 0.5).clamp(0, 1)


def rescaled_cfg(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """Qwen-Image's CFG: ``uncond + scale * (cond - uncond)`` rescaled per token to the norm of
    ``cond`` (norms over the last dim). cond, uncond: ``[B, seq, C]``."""
    combined = uncond + scale * (cond - uncond)
    cond_norm = torch.norm(cond, dim=-1, keepdim=True)
    combined_norm = torch.norm(combined, dim=-1, keepdim=True)
    return combined * (cond_norm / combined_norm)


# --- tiny model ------------------------------------------------------------------------
TEXT_DIM = 32  # tiny Qwen2.5-VL hidden size (the transformer's joint_attention_dim)


def build_tiny_qwen_image(out_dir: Path, *, seed: int, resolution: int) -> None:
    """Write a tiny Qwen-Image ``QwenImagePipeline`` folder: a 1-block MMDiT (64 packed
    channels, 2x2 patches), a 2-layer Qwen2.5-VL text encoder (with a 1-block vision tower, as
    the class has one), the Wan-style 3D VAE (scale 8, 16 channels, Qwen-Image's latent
    mean/std) and Qwen-Image's scheduler config."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )

    check_resolution(resolution)
    shell: Any = QwenImagePipeline(None, None, None, None, None)  # for its prompt template
    tokenizer = tiny_qwen_tokenizer(shell.prompt_template_encode)
    transformer = text.seeded(
        _sub_seed(seed, 0),
        lambda: QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=64,
            out_channels=16,
            num_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=TEXT_DIM,
            axes_dims_rope=(4, 6, 6),
        ),
    )
    vae = text.seeded(
        _sub_seed(seed, 1),
        lambda: AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1),
    ).eval()
    pipe: Any = QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
        vae=vae,
        text_encoder=tiny_qwen_vl(tokenizer, seed=_sub_seed(seed, 2)),
        tokenizer=tokenizer,
        transformer=transformer,
    )
    pipe.save_pretrained(out_dir)


def tiny_qwen_tokenizer(template: str):  # -> transformers.Qwen2Tokenizer
    """A ``Qwen2Tokenizer`` (Qwen's byte-level pre-tokenizer) over :func:`text.template_bpe`
    plus Qwen's chat and vision special tokens. ``template`` (the pipeline's prompt template)
    tokenizes to the same number of tokens as with the real vocabulary, so the pipeline drops
    exactly its system prefix."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer  # type: ignore[attr-defined]
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    vocab, pairs = text.template_bpe(PRETOKENIZE_REGEX, template, QWEN_SPECIAL_TOKENS)
    tok = Qwen2Tokenizer(vocab=vocab, merges=pairs)
    tok.add_tokens([AddedToken(s, special=True) for s in QWEN_SPECIAL_TOKENS], special_tokens=True)
    return tok


def tiny_qwen_vl(tokenizer, *, seed: int):  # -> Qwen2_5_VLForConditionalGeneration
    """A 2-layer ``Qwen2_5_VLForConditionalGeneration`` sized to ``tokenizer`` (multimodal rope
    sections scaled to the tiny head dim; vision token ids are the tokenizer's)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = {s: tokenizer.convert_tokens_to_ids(s) for s in QWEN_SPECIAL_TOKENS}
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": TEXT_DIM,
            "intermediate_size": 2 * TEXT_DIM,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 2048,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [1, 1, 2]},
            "bos_token_id": None,
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": TEXT_DIM,
            "fullatt_block_indexes": [0],
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    return text.seeded(seed, lambda: Qwen2_5_VLForConditionalGeneration(config)).eval()
