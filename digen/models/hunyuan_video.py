"""HunyuanVideo (``HunyuanVideoPipeline``) as a :class:`FlowPolicy`, and its tiny builder.

Step space: the video latent ``[C=16, (F-1)/4 + 1, H/8, W/8]`` of ``AutoencoderKLHunyuanVideo``
(scaled by its ``scaling_factor``). The transformer takes ``timestep = 1000 * sigma``,
``guidance = 1000 * guidance_scale`` (HunyuanVideo is guidance-distilled: embedded guidance, one
pass), Llama hidden states over the pipeline's prompt template (template cropped, padded to
``max_sequence_length``) with their attention mask, and CLIP's pooled output. A transformer
without guidance embedding would use true CFG with the empty prompt instead.

transformers 5 opens a ``LlamaTokenizerFast`` folder with a SentencePiece pre-tokenizer even
when its ``tokenizer.json`` is byte-level BPE (Llama-3, as HunyuanVideo's; transformers issue
45488), which silently changes every prompt's tokens. The adapter reopens such a tokenizer from
its ``tokenizer.json`` as is; the tiny model's folder is laid out like the Hub's, so tests go
through the same path.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from digen.models import lora, text
from digen.models.tiny import _sub_seed, check_resolution, save_pipeline
from digen.models.video import VideoPolicy

# The pre-tokenizer regex of Llama-3's tokenizer.json (numbers split in runs of up to 3 digits).
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_BOS, LLAMA3_EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<pad>"
LLAMA3_SPECIAL_TOKENS = (
    LLAMA3_BOS,
    LLAMA3_EOS,
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    PAD,
)


class HunyuanVideoPolicy(VideoPolicy):
    family = "hunyuan-video"
    default_lora_targets = lora.SD3_TARGETS  # attention projections, text-stream ones included
    default_max_sequence_length = 256  # HunyuanVideoPipeline's default Llama length
    default_num_frames = 129  # HunyuanVideoPipeline's default

    def __init__(self, pipe, **kwargs):
        pipe.tokenizer = byte_level_tokenizer(pipe.tokenizer)
        super().__init__(pipe, **kwargs)

    @property
    def spatial_patch(self) -> int:
        return int(self.config.patch_size)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """As ``HunyuanVideoPipeline`` sets them: sigmas ``linspace(1, 0, num_steps + 1)[:-1]``
        through the scheduler's static shift (7.0 for HunyuanVideo). Returns ``[num_steps + 1]``
        float32 on the host."""
        import numpy as np

        scheduler = self.pipe.scheduler
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.0, num_steps + 1)[:-1])
        return scheduler.sigmas.to("cpu", torch.float32).clone()

    def _encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """``encoder_hidden_states [B, L, D]`` (Llama, template cropped, padded to
        ``L = max_sequence_length``), ``encoder_attention_mask [B, L]``, ``pooled_projections
        [B, P]`` (CLIP) via the pipeline's ``encode_prompt``; ``uncond`` encodes the empty prompt
        (used only without guidance embedding)."""
        embeds, pooled, mask = self.pipe.encode_prompt(
            prompt=prompts, device=self.device, max_sequence_length=self.max_sequence_length
        )
        return {"encoder_hidden_states": embeds, "encoder_attention_mask": mask, "pooled_projections": pooled}

    def transformer_kwargs(
        self, x: torch.Tensor, tensors: dict[str, torch.Tensor], guidance_scale: float
    ) -> dict[str, Any]:
        """The prompt tensors (mask included) in the model dtype and ``guidance [N]``:
        ``HunyuanVideoPipeline.__call__``'s ``tensor([g] * N, dtype) * 1000``."""
        guidance = (
            torch.full((x.shape[0],), float(guidance_scale), device=self.device, dtype=self.dtype) * 1000.0
        )
        return {**super().transformer_kwargs(x, tensors, guidance_scale), "guidance": guidance}

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """latents ``[B, C, F', h, w]`` -> frames ``[B, F, 3, H, W]`` float32 in [0, 1]."""
        vae = self.pipe.vae
        z = latents.to(vae.device, vae.dtype) / vae.config.scaling_factor
        return self.to_frames(vae.decode(z, return_dict=False)[0])


def byte_level_tokenizer(tokenizer: Any) -> Any:
    """``tokenizer`` itself, or, when transformers rebuilt a byte-level ``tokenizer.json`` as a
    SentencePiece-style ``LlamaTokenizer``, that ``tokenizer.json`` reopened unchanged."""
    from transformers import LlamaTokenizer, PreTrainedTokenizerFast  # type: ignore[attr-defined]

    folder = Path(str(getattr(tokenizer, "name_or_path", "")))
    file = folder / "tokenizer.json"
    if not isinstance(tokenizer, LlamaTokenizer) or not file.is_file():
        return tokenizer
    if '"ByteLevel"' not in file.read_text(encoding="utf-8"):
        return tokenizer
    return PreTrainedTokenizerFast.from_pretrained(str(folder))


# --- tiny model ------------------------------------------------------------------------
TEXT_DIM = 32  # tiny Llama and CLIP widths (the transformer's text_embed_dim, pooled_projection_dim)


def build_tiny_hunyuan_video(out_dir: Path, *, seed: int, resolution: int) -> None:
    """Write a tiny HunyuanVideo ``HunyuanVideoPipeline`` folder: a transformer with 1 dual- and
    1 single-stream block, 1 token-refiner block and guidance embedding; a 3-layer Llama encoder
    with a Llama-3-style byte-level tokenizer (saved as the Hub's ``LlamaTokenizerFast``
    entry); the tiny CLIP encoder; the causal 3D VAE (8x space, 4x time, 16 channels); a
    shift-7 Euler scheduler."""
    from diffusers import (
        AutoencoderKLHunyuanVideo,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideoPipeline,
        HunyuanVideoTransformer3DModel,
    )
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

    check_resolution(resolution)
    llama_tok = tiny_llama3_tokenizer(str(DEFAULT_PROMPT_TEMPLATE["template"]))
    clip_tok = text.tiny_clip_tokenizer()
    transformer = text.seeded(
        _sub_seed(seed, 0),
        lambda: HunyuanVideoTransformer3DModel(
            in_channels=16,
            out_channels=16,
            num_attention_heads=2,
            attention_head_dim=16,
            num_layers=1,
            num_single_layers=1,
            num_refiner_layers=1,
            mlp_ratio=2.0,
            patch_size=2,
            patch_size_t=1,
            guidance_embeds=True,
            text_embed_dim=TEXT_DIM,
            pooled_projection_dim=TEXT_DIM,
            rope_axes_dim=(4, 6, 6),
        ),
    )
    vae = text.seeded(
        _sub_seed(seed, 1),
        lambda: AutoencoderKLHunyuanVideo(
            latent_channels=16,
            block_out_channels=(8, 8, 16, 16),
            layers_per_block=1,
            norm_num_groups=4,
        ),
    ).eval()
    pipe: Any = HunyuanVideoPipeline(
        text_encoder=tiny_llama(llama_tok, seed=_sub_seed(seed, 2)),
        tokenizer=llama_tok,
        transformer=transformer,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=7.0),
        text_encoder_2=text.tiny_clip_text_model(
            clip_tok, seed=_sub_seed(seed, 3), hidden_size=TEXT_DIM, with_projection=False
        ),
        tokenizer_2=clip_tok,
    )
    save_pipeline(pipe, out_dir, ("tokenizer_2",))
    _as_hub_llama_tokenizer(out_dir)


def _as_hub_llama_tokenizer(out_dir: Path) -> None:
    """Name the Llama tokenizer as HunyuanVideo's Hub folder does: ``LlamaTokenizerFast`` in
    ``model_index.json``, ``PreTrainedTokenizerFast`` in ``tokenizer_config.json``."""
    index_file, config_file = out_dir / "model_index.json", out_dir / "tokenizer" / "tokenizer_config.json"
    index = json.loads(index_file.read_text())
    index["tokenizer"] = ["transformers", "LlamaTokenizerFast"]
    index_file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def tiny_llama3_tokenizer(template: str):  # -> transformers.PreTrainedTokenizerFast
    """A Llama-3-style tokenizer: byte-level BPE over :func:`text.template_bpe` with Llama-3's
    pre-tokenizer regex and special tokens, ``<|begin_of_text|>`` prepended, right padding with
    ``<pad>``. ``template`` (the pipeline's prompt template) tokenizes to as many tokens as with
    the real vocabulary, so the pipeline's ``crop_start`` (95) cuts exactly the template."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast  # type: ignore[attr-defined]

    vocab, pairs = text.template_bpe(LLAMA3_SPLIT, template, LLAMA3_SPECIAL_TOKENS)
    backend = Tokenizer(BPE(vocab=vocab, merges=pairs, ignore_merges=True))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(s, special=True) for s in LLAMA3_SPECIAL_TOKENS])
    bos_id = backend.token_to_id(LLAMA3_BOS)
    backend.post_processor = processors.TemplateProcessing(
        single=f"{LLAMA3_BOS} $A",
        pair=f"{LLAMA3_BOS} $A {LLAMA3_BOS} $B",
        special_tokens=[(LLAMA3_BOS, bos_id)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=LLAMA3_BOS,
        eos_token=LLAMA3_EOS,
        pad_token=PAD,
        padding_side="right",
    )


def tiny_llama(tokenizer, *, seed: int):  # -> transformers.LlamaModel
    """A 3-layer ``LlamaModel`` sized to ``tokenizer`` (the pipeline reads the third-last hidden
    state, so it needs three layers to read a contextual one)."""
    from transformers import LlamaConfig, LlamaModel

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=TEXT_DIM,
        intermediate_size=2 * TEXT_DIM,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return text.seeded(seed, lambda: LlamaModel(config)).eval()
