"""Checks every diffusers family adapter passes, called from the per-family test files
(test_qwen_image.py, test_wan.py, test_hunyuan_video.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from digen.models import FlowPolicy, PromptEmbeds

from ._helpers import noise

PROMPTS = ["a photo of a cat", "a big red car on the street at night"]


def check_folder_is_small(path: Path) -> None:
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    assert size < 4 * 2**20


def check_velocity_rows(policy: FlowPolicy, embeds: PromptEmbeds, guidance_scale: float) -> None:
    """Shape/dtype, each row of a batch with per-row sigmas equals that row alone, and the
    sigmas matter."""
    x = noise(policy, 2)
    sigmas = torch.tensor([0.95, 0.2])
    v = policy.velocity(x, sigmas, embeds, guidance_scale)
    assert v.shape == x.shape == (2, *policy.latent_shape()) and v.dtype == torch.float32
    for row in range(2):
        alone = policy.velocity(x[row : row + 1], sigmas[row : row + 1], embeds.index([row]), guidance_scale)
        torch.testing.assert_close(v[row : row + 1], alone, atol=1e-5, rtol=0)
    assert not torch.allclose(policy.velocity(x, sigmas.flip(0), embeds, guidance_scale), v, atol=1e-4)


def check_lora(
    policy: FlowPolicy, embeds: PromptEmbeds, guidance_scale: float, expect: tuple[str, ...]
) -> None:
    """LoRA starts equal to the base model; the trainable state is only adapter tensors on
    the ``expect`` projections, far smaller than the transformer."""
    full_bytes = sum(p.numel() * 4 for p in policy.transformer.parameters())
    assert sum(v.numel() * 4 for v in policy.trainable_state_dict().values()) == full_bytes
    x, sigmas = noise(policy, 2), torch.tensor([0.9, 0.4])
    with torch.no_grad():
        base = policy.velocity(x, sigmas, embeds, guidance_scale)
        policy.enable_lora(rank=2, alpha=4)
        assert torch.equal(policy.velocity(x, sigmas, embeds, guidance_scale), base)
    state = policy.trainable_state_dict()
    assert state and all(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in state)
    assert all(any(f".{name}.lora_A." in k for k in state) for name in expect)
    assert set(state) == {n for n, _ in policy.named_trainable_parameters()}
    assert sum(v.numel() * 4 for v in state.values()) < 0.2 * full_bytes
