"""Precision: each part of the model in the dtype its key names, and on-policy ratios of 1.

A bfloat16 transformer with float32 LoRA weights (Flow-GRPO's and DanceGRPO's split of frozen
and trained weights) runs on CPU, which has bfloat16 kernels. At staleness 0 the first step of
every iteration recomputes the rollout's log-probs with the weights the rollout used, so
``ratio_max_dev`` is 0 and nothing clips: the trainers publish each version in the dtype they
compute with (docs/precision.md), not cast to the transformer's dtype.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from digen.assembly import build_policy, trained_dtype


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_every_part_is_in_the_dtype_its_key_names(small_config):
    cfg = small_config(
        model__dtype="bfloat16",
        model__text_encoder_dtype="float32",
        model__vae_dtype="bfloat16",
        model__autocast="bfloat16",
        model__lora={"enabled": True, "rank": 4, "alpha": 8, "dtype": "float32"},
    )
    policy = build_policy(cfg)
    pipe = policy.pipe
    trained = {p.dtype for p in policy.transformer.parameters() if p.requires_grad}
    frozen = {p.dtype for p in policy.transformer.parameters() if not p.requires_grad}
    assert trained == {torch.float32} == {trained_dtype(cfg)} and frozen == {torch.bfloat16}
    assert pipe.text_encoder_3.dtype == pipe.text_encoder.dtype == torch.float32
    assert pipe.vae.dtype == torch.bfloat16 and policy.autocast_dtype == torch.bfloat16
    assert str(policy.device) == "cpu"  # model.device auto on a machine without a GPU
    # the forward runs under autocast: the matmuls of the float32 adapter compute in bfloat16
    seen: list[torch.dtype] = []
    lora_a = next(m for n, m in policy.transformer.named_modules() if n.endswith("lora_A.default"))
    hook = lora_a.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    embeds = policy.encode_prompts(["a red square"], with_uncond=False)
    latents = torch.zeros(1, *policy.latent_shape())
    velocity = policy.velocity(latents, torch.tensor([0.5]), embeds, 1.0)
    hook.remove()
    assert seen and set(seen) == {torch.bfloat16} and velocity.dtype == torch.float32


@pytest.mark.parametrize("lora_dtype", ["float32", "bfloat16"])
def test_a_bfloat16_lora_adapter_is_the_float32_one_rounded(small_config, lora_dtype):
    cfg = small_config(
        model__dtype="bfloat16", model__lora={"enabled": True, "rank": 4, "alpha": 8, "dtype": lora_dtype}
    )
    weights = build_policy(cfg).trainable_state_dict()
    full = build_policy(small_config(model__dtype="bfloat16")).trainable_state_dict()
    for k, v in weights.items():
        assert v.dtype == torch.float32  # what a sync and a checkpoint carry
        assert torch.equal(v, full[k].to(trained_dtype(cfg)).float())


@pytest.mark.slow
def test_digen_mode_bfloat16_is_on_policy_at_staleness_0(small_config, tmp_path):
    """A bfloat16 transformer, float32 LoRA weights: the rollout worker loads the version the
    trainer computes with, so the second iteration (the first with a non-zero adapter B) clips
    nothing. Published cast to bfloat16, as digen did before, it gave ratio deviations of
    ~1e-3 at iteration 1."""
    from digen.runtime.controller import run_distributed

    cfg = small_config(
        model__dtype="bfloat16",
        schedule={"mode": "digen", "max_staleness": 0},
        cluster__local={"rollout_workers": 1, "trainer_workers": 1},
        train__clip_range=1e-5,
        train__lr=1e-2,
        output__sample_grid_every=0,
    )
    assert trained_dtype(cfg) == torch.float32
    run_distributed(cfg, tmp_path / "run")
    rows = _metrics(tmp_path / "run")
    assert [r["iteration"] for r in rows] == [0, 1]
    assert [(r["ratio_max_dev"], r["clipfrac"]) for r in rows] == [(0.0, 0.0), (0.0, 0.0)]
    assert rows[1]["grad_norm"] > 0  # iteration 1 generated with a version that moved
