"""Tiny random-weight diffusers pipelines, built offline, for tests and demos.

:func:`build_tiny_sd3` and :func:`build_tiny_flux` write a complete pipeline folder
(``model_index.json`` plus one subfolder per component, safetensors weights) that
``StableDiffusion3Pipeline.from_pretrained`` / ``FluxPipeline.from_pretrained`` open with no
network, exactly like SD3.5 / FLUX.1-dev on disk, only with 1-2 transformer layers and small
widths (under a few MB). The real models' latent layout is kept: 16 latent channels, VAE scale
factor 8, SD3's patch 2 / FLUX's 2x2 packing, their VAE shift/scaling factors and scheduler
configs. Weights are a pure function of ``seed``. Use :func:`digen.models.make_tiny_model`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from digen.errors import ConfigError
from digen.models import text

# Real VAE normalisation constants (SD3.5 and FLUX.1 vae/config.json).
SD3_VAE_SCALING, SD3_VAE_SHIFT = 1.5305, 0.0609
FLUX_VAE_SCALING, FLUX_VAE_SHIFT = 0.3611, 0.1159
LATENT_CHANNELS = 16
T5_DIM = 64
CLIP_DIM = 32


def _sub_seed(seed: int, component: int) -> int:
    """A distinct, stable seed per component, so weights do not depend on build order."""
    return seed * 1009 + component


def check_resolution(resolution: int, multiple: int = 16) -> None:
    if resolution <= 0 or resolution % multiple:
        raise ConfigError(
            f"resolution ({resolution}) must be a positive multiple of {multiple} "
            f"(VAE scale 8 x patch 2); try 32"
        )


def autoencoder_kl(
    *, seed: int, block_out_channels: tuple[int, ...], latent_channels: int, sample_size: int, **config: Any
):  # -> diffusers.AutoencoderKL
    """A seeded RGB ``AutoencoderKL`` with ``len(block_out_channels)`` levels (scale factor
    ``2 ** (levels - 1)``), one layer per block, 4 norm groups and no quant convs, like SD3.5's
    and FLUX's VAEs; ``config``: further ``AutoencoderKL`` arguments."""
    from diffusers import AutoencoderKL

    levels = len(block_out_channels)
    return text.seeded(
        seed,
        lambda: AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * levels,
            up_block_types=("UpDecoderBlock2D",) * levels,
            block_out_channels=block_out_channels,
            layers_per_block=1,
            latent_channels=latent_channels,
            norm_num_groups=4,
            sample_size=sample_size,
            use_quant_conv=False,
            use_post_quant_conv=False,
            **config,
        ),
    )


def tiny_vae(*, seed: int, resolution: int, scaling_factor: float, shift_factor: float):
    """The tiny SD3/FLUX VAE: 4 levels (scale factor 8), 16 latent channels."""
    return autoencoder_kl(
        seed=seed,
        block_out_channels=(8, 8, 16, 16),
        latent_channels=LATENT_CHANNELS,
        sample_size=resolution,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
    ).eval()


def sd3_text_stack(seed: int, clip_tok: Any, t5_tok: Any) -> dict[str, Any]:
    """``StableDiffusion3Pipeline``'s text components, keyed as it takes them: two CLIP encoders
    with projection (for CLIP-L and CLIP-G) sharing ``clip_tok``, and a T5 on ``t5_tok``."""
    return {
        "text_encoder": text.tiny_clip_text_model(
            clip_tok, seed=_sub_seed(seed, 2), hidden_size=CLIP_DIM, with_projection=True
        ),
        "tokenizer": clip_tok,
        "text_encoder_2": text.tiny_clip_text_model(
            clip_tok, seed=_sub_seed(seed, 3), hidden_size=CLIP_DIM, with_projection=True
        ),
        "tokenizer_2": clip_tok,
        "text_encoder_3": text.tiny_t5_encoder(t5_tok, seed=_sub_seed(seed, 4), d_model=T5_DIM),
        "tokenizer_3": t5_tok,
    }


def sd3_transformer(
    *,
    seed: int,
    sample_size: int,
    latent_channels: int,
    layers: int,
    width: int,
    head_dim: int,
    pos_embed_max_size: int,
    dual_attention_layers: tuple[int, ...] = (),
):  # -> diffusers.SD3Transformer2DModel
    """A seeded ``SD3Transformer2DModel`` (patch 2, RMS qk-norm like SD3.5) of ``layers`` MMDiT
    blocks ``width`` wide in heads of ``head_dim``, over ``latent_channels`` latents, that reads
    what :func:`sd3_text_stack` encodes (T5 tokens, the two CLIPs' pooled projections)."""
    from diffusers import SD3Transformer2DModel

    return text.seeded(
        seed,
        lambda: SD3Transformer2DModel(
            sample_size=sample_size,
            patch_size=2,
            in_channels=latent_channels,
            out_channels=latent_channels,
            num_layers=layers,
            attention_head_dim=head_dim,
            num_attention_heads=width // head_dim,
            joint_attention_dim=T5_DIM,
            caption_projection_dim=width,
            pooled_projection_dim=2 * CLIP_DIM,
            pos_embed_max_size=pos_embed_max_size,
            dual_attention_layers=dual_attention_layers,
            qk_norm="rms_norm",
        ),
    )


def save_pipeline(pipe: Any, out_dir: Path, clip_tokenizers: tuple[str, ...]) -> None:
    """``save_pretrained`` (safetensors), then the tiny CLIP vocabulary (:func:`text.clip_bpe`)
    written as ``vocab.json``/``merges.txt`` into each CLIP tokenizer folder of
    ``clip_tokenizers``."""
    pipe.save_pretrained(out_dir)
    for sub in clip_tokenizers:
        text.write_bpe_files(out_dir / sub, *text.clip_bpe())


def build_tiny_sd3(
    out_dir: Path, *, seed: int, resolution: int, layers: int = 2, heads: int = 2, head_dim: int = 16
) -> None:
    """Write a tiny SD3.5-style ``StableDiffusion3Pipeline`` folder (MMDiT with 2 blocks, one
    dual-attention, RMS qk-norm; 2 CLIP-with-projection encoders + T5; shift-3 scheduler).
    ``layers``, ``heads``, ``head_dim`` size its transformer: the defaults make a few-MB test
    model; 4, 24, 64 make a 336M-parameter one (1.25 GiB in float32) whose full fine-tune
    exercises the data plane at a real size."""
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    check_resolution(resolution)
    transformer = sd3_transformer(
        seed=_sub_seed(seed, 0),
        sample_size=resolution // 8,
        latent_channels=LATENT_CHANNELS,
        layers=layers,
        width=heads * head_dim,
        head_dim=head_dim,
        pos_embed_max_size=32,
        dual_attention_layers=(0,),
    )
    pipe: Any = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
        vae=tiny_vae(
            seed=_sub_seed(seed, 1),
            resolution=resolution,
            scaling_factor=SD3_VAE_SCALING,
            shift_factor=SD3_VAE_SHIFT,
        ),
        **sd3_text_stack(seed, text.tiny_clip_tokenizer(), text.tiny_t5_tokenizer()),
    )
    save_pipeline(pipe, out_dir, ("tokenizer", "tokenizer_2"))


def build_tiny_flux(out_dir: Path, *, seed: int, resolution: int) -> None:
    """Write a tiny FLUX.1-dev-style ``FluxPipeline`` folder (1 double + 1 single block, guidance
    embedding; CLIP + T5 encoders; dynamic-shift scheduler config of FLUX.1-dev)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    check_resolution(resolution)
    clip_tok = text.tiny_clip_tokenizer()
    t5_tok = text.tiny_t5_tokenizer()
    transformer = text.seeded(
        _sub_seed(seed, 0),
        lambda: FluxTransformer2DModel(
            patch_size=1,
            in_channels=4 * LATENT_CHANNELS,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=T5_DIM,
            pooled_projection_dim=CLIP_DIM,
            guidance_embeds=True,
            axes_dims_rope=(4, 6, 6),
        ),
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    pipe: Any = FluxPipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=tiny_vae(
            seed=_sub_seed(seed, 1),
            resolution=resolution,
            scaling_factor=FLUX_VAE_SCALING,
            shift_factor=FLUX_VAE_SHIFT,
        ),
        text_encoder=text.tiny_clip_text_model(
            clip_tok, seed=_sub_seed(seed, 2), hidden_size=CLIP_DIM, with_projection=False
        ),
        tokenizer=clip_tok,
        text_encoder_2=text.tiny_t5_encoder(t5_tok, seed=_sub_seed(seed, 4), d_model=T5_DIM),
        tokenizer_2=t5_tok,
    )
    save_pipeline(pipe, out_dir, ("tokenizer",))


TinyBuilder = Callable[..., None]
