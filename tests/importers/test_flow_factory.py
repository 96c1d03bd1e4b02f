"""``digen import-config flow-factory`` on Flow-Factory's own recipes (tests/data/peers/flow_factory,
X-GenGroup/Flow-Factory a0b2bc5, Apache-2.0)."""

from __future__ import annotations

from pathlib import Path

import pytest

from digen.errors import ConfigError
from digen.importers import import_config

FF = Path(__file__).resolve().parents[1] / "data" / "peers" / "flow_factory" / "examples"


def test_the_sd35_grpo_recipe_imports_with_its_numbers():
    result = import_config("flow-factory", str(FF / "grpo" / "lora" / "sd3_5" / "default.yaml"))
    result.validate()
    c = result.config
    assert (c["rollout"]["batch_size"], c["rollout"]["group_size"], c["train"]["mini_batches"]) == (
        48 * 24,
        24,
        2,
    )
    assert (
        c["rollout"]["sde"] == {"kind": "sde", "noise_level": 0.8} and c["rollout"]["guidance_scale"] == 4.5
    )
    # 2 SDE steps drawn among [1..5]: digen's window of 2 in [1, 6), and the difference said aloud
    assert c["train"]["timesteps"] == {"strategy": "window", "window": 2, "window_range": [1, 6]}
    assert "randperm" in result.dropped["scheduler.sde_steps / num_sde_steps"]
    assert c["train"]["algorithm"] == "flow-grpo-fast" and c["train"]["global_std"] is True
    assert (c["model"]["lora"]["rank"], c["model"]["lora"]["alpha"]) == (32, 64)
    assert c["reward"] == [{"name": "pickscore", "weight": 1.0}]
    nocfg = import_config("flow-factory", str(FF / "grpo" / "lora" / "sd3_5" / "nocfg.yaml")).config
    assert nocfg["train"]["algorithm"] == "cps" and nocfg["rollout"]["guidance_scale"] == 1.0


@pytest.mark.parametrize(
    "recipe, cause",
    [
        ("dgpo/lora/sd3_5/default.yaml", r"train.trainer_type=dgpo: digen trains it \(train.algorithm: dgpo"),
        (
            "nft/lora/sd3_5/default.yaml",
            r"train.trainer_type=nft: digen trains it \(train.algorithm: diffusion-nft",
        ),
        ("grpo/lora/flux2/t2i.yaml", "model.model_type=flux2"),
        ("grpo/lora/wan22/t2v.yaml", "Wan2.2 is not a digen model family"),
    ],
)
def test_what_digen_cannot_train_is_refused_naming_the_key(recipe, cause):
    with pytest.raises(ConfigError, match=cause):
        import_config("flow-factory", str(FF / recipe))


def test_unset_keys_take_flow_factorys_defaults_and_gradient_checkpointing_is_carried(tmp_path):
    """GRPOTrainingArguments (src/flow_factory/hparams/training_args.py l.414-420): global_std
    true, advantage_aggregation 'gdpo' (train.multi_reward: gdpo); a recipe's
    enable_gradient_checkpointing is train.activation_checkpointing."""
    text = (FF / "grpo" / "lora" / "flux1" / "default.yaml").read_text()
    kept = [
        line for line in text.splitlines() if "advantage_aggregation" not in line and "global_std" not in line
    ]
    unset = tmp_path / "unset.yaml"
    unset.write_text(
        "\n".join(kept).replace("enable_gradient_checkpointing: false", "enable_gradient_checkpointing: true")
    )
    result = import_config("flow-factory", str(unset))
    result.validate()
    assert result.config["train"]["global_std"] is True
    assert (
        result.config["train"]["multi_reward"] == "gdpo"
        and "train.advantage_aggregation" not in result.dropped
    )
    assert result.config["train"]["activation_checkpointing"] is True
    assert "train.enable_gradient_checkpointing" not in result.dropped
    plain = import_config("flow-factory", str(FF / "grpo" / "lora" / "flux1" / "default.yaml"))
    assert (
        plain.config["train"]["global_std"] is False
        and "activation_checkpointing" not in plain.config["train"]
    )
    assert plain.config["train"]["multi_reward"] == "gdpo"  # the recipe's own
    sd35 = import_config("flow-factory", str(FF / "grpo" / "lora" / "sd3_5" / "default.yaml")).config
    assert sd35["train"]["multi_reward"] == "sum"
