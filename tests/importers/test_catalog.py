"""docs/peer-recipes.md is what the importers make of every peer recipe kept in tests/data/peers
(regenerate: python -m digen.importers.catalog tests/data/peers > docs/peer-recipes.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from digen.importers.catalog import markdown, rows

ROOT = Path(__file__).resolve().parents[2]
PEERS = ROOT / "tests" / "data" / "peers"


@pytest.mark.slow
def test_the_page_is_the_importers_output_and_every_recipe_has_a_row():
    table = rows(PEERS)
    assert markdown(table) == (ROOT / "docs" / "peer-recipes.md").read_text()
    scripts = {p for p in (PEERS / "verl_omni" / "examples").rglob("*.sh")}
    assert sum(r.peer == "verl-omni" for r in table) == len(scripts)
    assert sum(r.peer == "dance-grpo" for r in table) == len(
        list((PEERS / "dance_grpo" / "scripts" / "finetune").glob("*.sh"))
    )
    by = {(r.peer, r.recipe): r for r in table}
    # the headline recipes import as the algorithm they train; the refused ones say why in a line
    assert by["flow-grpo", "grpo.py:pickscore_sd3"].algorithm == "flow-grpo"
    assert by["flow-grpo", "grpo_guard.py:general_ocr_sd3_rationorm"].algorithm == "grpo-guard"
    assert (
        by["verl-omni", "examples/grpoguard_trainer/qwen_image/run_qwen_image_ocr_lora.sh"].algorithm
        == "grpo-guard"
    )
    assert by["dance-grpo", "scripts/finetune/finetune_flux_grpo_8gpus_lora.sh"].imported
    assert "mini_num_image_per_prompt" in by["flow-grpo", "grpo.py:pickscore_sd3_fast"].note
    assert all(r.note and "\n" not in r.note for r in table if not r.imported)
    assert "sample.noise_level" in by["flow-grpo", "grpo.py:general_ocr_wan2_1"].note  # loud where it differs


def _flat(node: dict, prefix: str = "") -> dict:
    out: dict = {}
    for key, value in node.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


# The math of a recipe, read by hand from the peer's config and training script (file:line in
# the comments), as the digen keys that carry it
GOLDEN = {
    # Flow-GRPO config/grpo.py l.609-652, scripts/train_flux_fast.py l.416-429, 446
    ("flow-grpo", "tests/data/peers/flow_grpo/config/grpo.py:pickscore_flux_fast"): {
        "train.algorithm": "flow-grpo-fast", "rollout.num_steps": 6, "rollout.guidance_scale": 3.5,
        "rollout.batch_size": 48 * 24, "rollout.group_size": 24, "train.mini_batches": 2,
        "rollout.sde.noise_level": 0.8, "train.timesteps.window": 3, "train.timesteps.window_range": [0, 3],
        "train.clip_range": 1e-5, "train.kl_beta": 0, "train.global_std": False, "model.lora.rank": 64,
        "model.lora.alpha": 128, "train.ema.micro_batches": 6, "train.ema.every": 8,
    },
    # VeRL-Omni examples/grpoguard_trainer/qwen_image/run_qwen_image_ocr_lora.sh
    ("verl-omni", "tests/data/peers/verl_omni/examples/grpoguard_trainer/qwen_image/run_qwen_image_ocr_lora.sh"): {
        "train.algorithm": "grpo-guard", "train.clip_range": 2e-6, "train.lr": 3e-4, "model.lora.rank": 64,
        "model.lora.alpha": 128, "rollout.group_size": 16, "rollout.batch_size": 32 * 16, "train.mini_batches": 2,
        "rollout.sde.noise_level": 1.2, "rollout.guidance_scale": 4.0, "train.timesteps.window": 2,
        "train.timesteps.window_range": [0, 5],
    },
    # DanceGRPO scripts/finetune/finetune_flux_grpo_8gpus_lora.sh, fastvideo/train_grpo_flux_lora.py l.659-664
    ("dance-grpo", "tests/data/peers/dance_grpo/scripts/finetune/finetune_flux_grpo_8gpus_lora.sh"): {
        "train.algorithm": "dance-grpo", "model.lora.enabled": True, "model.lora.rank": 128, "model.lora.alpha": 256,
        "train.lr": 3e-4, "rollout.num_steps": 12, "rollout.sde.noise_level": 0.3, "rollout.group_size": 12,
        "rollout.batch_size": 8 * 2 * 12, "train.mini_batches": 2, "train.grad_clip": 1.0, "train.weight_decay": 1e-4,
        "train.timesteps.fraction": 0.6, "rollout.guidance_scale": 3.5, "rollout.shared_noise": True,
    },
    # DanceGRPO scripts/finetune/finetune_hunyuan_grpo.sh, fastvideo/train_grpo_hunyuan.py l.128-131;
    # the per-reward advantages l.370-395 (--vq_coef 1.0, --mq_coef 0.0: the VQ term only)
    ("dance-grpo", "tests/data/peers/dance_grpo/scripts/finetune/finetune_hunyuan_grpo.sh"): {
        "rollout.guidance_scale": 6.018, "model.num_frames": 53, "rollout.num_steps": 16,
        "rollout.sde.noise_level": 0.25, "rollout.group_size": 24, "rollout.batch_size": 32 * 24,
        "train.mini_batches": 6, "train.lr": 1e-5, "model.lora.enabled": False, "rollout.shared_noise": True,
        "train.multi_reward": "per_reward",
        "reward": [{"name": "http", "weight": 1.0,
                    "kwargs": {"url": "http://127.0.0.1:8765/videoalign_vq", "name": "videoalign_vq"}}], "train.unbiased_std": True,
        "train.std_eps": 1e-8, "train.adv_clip": 5.0,
    },
    # Flow-Factory examples/grpo/lora/sd3_5/default.yaml
    ("flow-factory", "tests/data/peers/flow_factory/examples/grpo/lora/sd3_5/default.yaml"): {
        "rollout.batch_size": 48 * 24, "rollout.group_size": 24, "train.mini_batches": 2, "rollout.num_steps": 10,
        "rollout.guidance_scale": 4.5, "rollout.sde.noise_level": 0.8, "train.timesteps.window": 2,
        "train.clip_range": 1e-4, "train.lr": 3e-4, "train.global_std": True, "model.lora.rank": 32,
        "train.std_eps": 1e-6,  # src/flow_factory/advantage/advantage_processor.py l.259-262: max(std, 1e-6)
    },
}  # fmt: skip


def test_the_math_of_each_golden_recipe_as_read_by_hand():
    from digen.importers import import_config

    for (peer, spec), expected in GOLDEN.items():
        flat = _flat(import_config(peer, str(ROOT / spec)).config)
        assert {k: flat.get(k) for k in expected} == expected, spec
