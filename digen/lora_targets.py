"""The modules a LoRA adapts when ``model.lora.target_modules`` is unset: each family's
default, by pipeline class, and peft's rule for which module a target name selects.

Torch-free, so that :mod:`digen.checks` sizes a run's checkpoints (the adapter's parameter
count) from the same table the model adapters inject (:mod:`digen.models.lora`,
``PipelinePolicy.default_lora_targets``) without importing torch or diffusers. The families'
defaults are the peers' own lists where the peers agree; docs/models.md, "LoRA targets", has
the table.
"""

from __future__ import annotations

from collections.abc import Iterable

# SD3.5: every joint-attention projection of the MMDiT blocks. Flow-GRPO scripts/train_sd3.py
# l.419-428 (9745241) and VeRL-Omni's SD3.5 examples (a1139ba
# examples/flowgrpo_trainer/sd35/*.sh, ``target_modules``) agree.
SD3_TARGETS: tuple[str, ...] = (
    "attn.add_k_proj",
    "attn.add_q_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "attn.to_k",
    "attn.to_out.0",
    "attn.to_q",
    "attn.to_v",
)
# FLUX.1: the attention projections and both feed-forwards of the double blocks (the single
# blocks' attn.to_q/k/v match too; their proj_mlp/proj_out are left alone), Flow-GRPO
# scripts/train_flux.py l.411-424 and train_flux_fast.py. DanceGRPO's LoRA script adapts fewer
# (fastvideo/train_grpo_flux_lora.py: to_k, to_q, to_v, to_out.0), which its importer carries;
# VeRL-Omni has no FLUX recipe. Flow-GRPO's is the one GRPO LoRA recipe set on FLUX digen's
# examples follow (configs/examples/ocr-flux.yaml).
FLUX_TARGETS: tuple[str, ...] = (
    *SD3_TARGETS,
    "ff.net.0.proj",
    "ff.net.2",
    "ff_context.net.0.proj",
    "ff_context.net.2",
)
# Qwen-Image: the attention projections and the image and text MLPs of every block. Flow-GRPO
# scripts/train_qwenimage.py l.410-423 and VeRL-Omni's Qwen-Image examples
# (examples/flowgrpo_trainer/qwen_image/*.sh, ``target_modules``, without the ``attn.``
# prefix: the same modules) agree.
QWEN_IMAGE_TARGETS: tuple[str, ...] = (
    *SD3_TARGETS,
    "img_mlp.net.0.proj",
    "img_mlp.net.2",
    "txt_mlp.net.0.proj",
    "txt_mlp.net.2",
)
# Wan: every attention projection of the blocks: self-attention (attn1) and text cross-attention
# (attn2); add_k/v_proj exist on the image-conditioned (I2V) models only.
WAN_TARGETS: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0", "add_k_proj", "add_v_proj")

DEFAULT_TARGETS: dict[str, tuple[str, ...]] = {
    # pipeline class (model_index.json ``_class_name``) -> its family adapter's default_lora_targets
    "StableDiffusion3Pipeline": SD3_TARGETS,
    "FluxPipeline": FLUX_TARGETS,
    "QwenImagePipeline": QWEN_IMAGE_TARGETS,
    "WanPipeline": WAN_TARGETS,
    "HunyuanVideoPipeline": SD3_TARGETS,  # attention projections, text-stream ones included
}
"""Each family's LoRA targets when ``model.lora.target_modules`` is unset (tests/models check
that every adapter's ``default_lora_targets`` is its pipeline's entry)."""


def is_target(module: str, targets: Iterable[str]) -> bool:
    """Whether a LoRA with ``target_modules=targets`` adapts ``module`` (a dotted module name,
    ``transformer_blocks.0.attn.to_q``): peft's rule for a list of names, the name itself or
    its ending after a dot (``to_q`` selects ``attn.to_q``, never ``attn.add_to_q``)."""
    return any(module == t or module.endswith("." + t) for t in targets)
