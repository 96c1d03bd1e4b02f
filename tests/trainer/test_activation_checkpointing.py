"""``train.activation_checkpointing`` on a replicated (unsharded) trainer: each transformer
block is recomputed in the backward (its forward runs twice per training forward), and the
task gradient is the same bits as without it."""

from __future__ import annotations

import torch

from digen.assembly import build_policy
from digen.config import build_config
from digen.parallel.fsdp import block_modules
from digen.training import build_rows, task_gradient
from tests.conftest import small_config_data


def _policy(tiny_sd3, checkpointing: bool, lora: bool):
    data = small_config_data(tiny_sd3, train={"activation_checkpointing": checkpointing})
    data["model"]["lora"]["enabled"] = lora
    cfg = build_config(data)
    return build_policy(cfg), cfg


def _rows(policy, steps: int = 4):
    g = torch.Generator().manual_seed(0)
    x0 = policy.initial_noise(g)
    latents = torch.randn(3, steps + 1, *x0.shape, generator=g)
    log_probs = torch.randn(3, steps, generator=g)
    return build_rows(
        latents, log_probs, policy.sigmas(steps), torch.tensor([1.0, -0.5, 0.3]), [[0, 1], [2], [1, 3]]
    )


def test_checkpointed_blocks_recompute_and_give_the_same_gradient(tiny_sd3):
    for lora in (True, False):
        grads, calls = {}, {}
        for ckpt in (False, True):
            policy, cfg = _policy(tiny_sd3, ckpt, lora)
            block = block_modules(policy.transformer)[0]
            inner = next(m for m in block.modules() if isinstance(m, torch.nn.LayerNorm))
            seen: list[bool] = []
            inner.register_forward_hook(lambda *_, _seen=seen: _seen.append(torch.is_grad_enabled()))
            embeds = policy.encode_prompts(["a red square"], with_uncond=False).repeat_rows(3)
            rows = _rows(policy)
            grads[ckpt], stats = task_gradient(policy, rows, embeds, cfg, tsp=True, sigma_max=0.9)
            calls[ckpt] = len(seen)
            assert stats.rows == len(rows) == 5
        assert calls[True] == 2 * calls[False] > 0, (lora, calls)  # recomputed in the backward
        assert grads[True].keys() == grads[False].keys()
        assert any(bool(g.abs().sum() > 0) for g in grads[False].values())
        for k in grads[False]:
            assert torch.equal(grads[True][k], grads[False][k]), (lora, k)
