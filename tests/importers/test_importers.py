"""``digen import-config`` on the peers' own files (tests/data/peers/, with their licences).

Flow-GRPO's ``pickscore_sd3`` must give configs/examples/pickscore-sd35.yaml in every key the
two share; VeRL-Omni's and DanceGRPO's headline scripts the examples written from them. Every
key of the peers' inputs is carried or listed with a reason, and the Flow-GRPO reader never
runs the file it reads.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from digen.cli.main import app
from digen.config import load_config
from digen.errors import ConfigError
from digen.importers import import_config
from digen.importers.flow_grpo import _CARRIED, NO_EQUIVALENT, SCRIPTS
from digen.importers.pyconfig import UNEVALUATED, ConfigModule, flatten

ROOT = Path(__file__).resolve().parents[2]
PEERS = ROOT / "tests" / "data" / "peers"
GRPO = PEERS / "flow_grpo" / "config" / "grpo.py"
BASE = PEERS / "flow_grpo" / "config" / "base.py"
VO = PEERS / "verl_omni" / "examples" / "flowgrpo_trainer"
DANCE = PEERS / "dance_grpo" / "scripts" / "finetune" / "finetune_flux_grpo.sh"
EXAMPLES = ROOT / "configs" / "examples"


def _flat(node: dict, prefix: str = "") -> dict:
    out: dict = {}
    for key, value in node.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _shared_differences(imported: dict, example: Path) -> tuple[dict, set]:
    a, b = _flat(yaml.safe_load(example.read_text())), _flat(imported)
    shared = a.keys() & b.keys()
    return {k: (a[k], b[k]) for k in shared if a[k] != b[k]}, shared


def test_pickscore_sd3_equals_the_shipped_example_in_every_shared_key():
    result = import_config("flow-grpo", f"{GRPO}:pickscore_sd3")
    diff, shared = _shared_differences(result.config, EXAMPLES / "pickscore-sd35.yaml")
    assert diff == {}
    assert len(shared) >= 40  # the whole recipe, not a few keys
    c = result.config
    # the numbers the hand port got wrong, and the script's own
    assert c["model"]["dtype"] == "float32" and c["model"]["text_encoder_dtype"] == "float16"
    assert c["model"]["max_sequence_length"] == 128 and c["model"]["device"] == "cuda"
    assert (c["model"]["lora"]["rank"], c["model"]["lora"]["alpha"]) == (32, 64)
    assert c["rollout"]["batch_size"] == 32 * 9 * 4 and c["train"]["mini_batches"] == 2


def test_the_cli_writes_a_config_digen_train_accepts(tmp_path):
    out = tmp_path / "pickscore.yaml"
    r = CliRunner().invoke(app, ["import-config", "flow-grpo", f"{GRPO}:pickscore_sd3", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "not carried num_epochs" in r.output and "fill in model.path" in r.output
    cfg = load_config(out, check_paths=False)
    assert cfg.train.kl_beta == 0.01 and cfg.reward[0].kwargs == {"divisor": 26}
    again = CliRunner().invoke(
        app, ["import-config", "flow-grpo", f"{GRPO}:pickscore_sd3", "--out", str(out)]
    )
    assert again.exit_code == 2 and "--force" in again.output


def test_a_misspelt_recipe_exits_2_with_one_line():
    r = CliRunner().invoke(app, ["import-config", "flow-grpo", f"{GRPO}:pickscore_sd"])
    assert r.exit_code == 2
    assert "did you mean 'pickscore_sd3'" in r.output and len(r.output.strip().splitlines()) == 1


def _recipes() -> list[str]:
    tree = ast.parse(GRPO.read_text())
    return [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name != "get_config"]


# compressibility is a base the others build on (1 image a prompt: no group to compare);
# pickscore_sd3_fast trains 9 of each 24 images (train_sd3_fast.py), which digen has not
REFUSED = {"compressibility", "pickscore_sd3_fast"}
# FLUX.1-Kontext, Qwen-Image-Edit and BAGEL are not digen families: refused by name
NOT_FAMILIES = {"counting_flux_kontext", "counting_qwenimage_edit", "counting_qwenimage_edit_fast",
                "counting_qwenimage_edit_8gpu", "pickscore_bagel", "pickscore_bagel_lora"}  # fmt: skip


@pytest.mark.parametrize("recipe", _recipes())
def test_every_recipe_imports_to_a_valid_config_or_says_why_not(recipe):
    if recipe in NOT_FAMILIES:
        with pytest.raises(ConfigError, match="is not a digen model family"):
            import_config("flow-grpo", f"{GRPO}:{recipe}")
        return
    if recipe in REFUSED:
        with pytest.raises(ConfigError, match="sample.num_image_per_prompt"):
            import_config("flow-grpo", f"{GRPO}:{recipe}")
        return
    result = import_config("flow-grpo", f"{GRPO}:{recipe}")
    result.validate()
    fg = flatten(ConfigModule(GRPO, base=ConfigModule(BASE)).call(recipe))
    for key in fg:
        assert key in _CARRIED or key in result.dropped, key


def test_lora_text_length_and_precision_follow_the_recipe_s_script():
    flux = import_config("flow-grpo", f"{GRPO}:pickscore_flux").config
    assert (flux["model"]["lora"]["rank"], flux["model"]["lora"]["alpha"]) == (64, 128)
    assert flux["model"]["text_encoder_dtype"] == "bfloat16" and flux["model"]["dtype"] == "float32"
    assert flux["train"]["zero_advantage"] == "keep" and flux["rollout"]["sde"]["noise_level"] == 0.9
    wan = import_config("flow-grpo", f"{GRPO}:general_ocr_wan2_1").config
    assert wan["model"]["max_sequence_length"] == 512 and wan["model"]["num_frames"] == 33
    fast = import_config("flow-grpo", f"{GRPO}:geneval_sd3_fast_nocfg").config
    assert fast["train"]["timesteps"] == {"strategy": "window", "window": 3, "window_range": [0, 5]}
    assert fast["rollout"]["sde"]["kind"] == "cps" and fast["train"]["algorithm"] == "flow-grpo-fast"
    assert set(SCRIPTS) >= {"train_sd3.py", "train_flux.py", "train_wan2_1.py"}


def test_every_base_key_is_carried_or_explained_and_on_the_page():
    keys = flatten(ConfigModule(BASE).call("get_config"))
    page = (ROOT / "docs" / "coming-from-flow-grpo.md").read_text()
    for key in keys:
        assert key in _CARRIED or key in NO_EQUIVALENT, key
        assert f"`{key}" in page or f"`{key.rsplit('.', 1)[-1]}" in page, key


def test_the_reader_runs_nothing_of_the_file(tmp_path):
    marker = tmp_path / "ran"
    src = tmp_path / "evil.py"
    src.write_text(
        "import ml_collections\n"
        "def recipe():\n"
        "    config = ml_collections.ConfigDict()\n"
        f"    config.a = __import__('os').system('touch {marker}')\n"
        f"    config.b = open('{marker}', 'w')\n"
        "    config.c = 2 ** 10000\n"
        "    config.d = 3 * (4 + 1) // 2\n"
        "    config.e = 'a' * 10 ** 12\n"
        "    config.f = ((2 ** 64) ** 64) ** 64\n"
        "    return config\n"
    )
    cfg = ConfigModule(src).call("recipe")
    assert not marker.exists()
    assert cfg["a"] is UNEVALUATED and cfg["b"] is UNEVALUATED and cfg["c"] is UNEVALUATED
    assert cfg["d"] == 7 and cfg["e"] is UNEVALUATED and cfg["f"] is UNEVALUATED
    loop = tmp_path / "loop.py"
    loop.write_text("def recipe():\n    for i in range(3):\n        pass\n    return None\n")
    with pytest.raises(ConfigError, match="For statement"):
        ConfigModule(loop).call("recipe")


def test_verl_omni_headline_script_equals_its_example():
    result = import_config("verl-omni", str(VO / "qwen_image" / "run_qwen_image_ocr_lora.sh"))
    result.validate()
    diff, shared = _shared_differences(result.config, EXAMPLES / "qwen-image-ocr-verl-omni.yaml")
    assert diff == {} and len(shared) >= 30


def test_verl_omni_sd35_script_carries_its_overrides():
    result = import_config("verl-omni", str(VO / "sd35" / "run_sd35_medium_ocr_lora.sh"))
    result.validate()
    c = result.config
    assert (c["model"]["lora"]["rank"], c["model"]["lora"]["alpha"], c["model"]["resolution"]) == (
        32,
        64,
        384,
    )
    assert (c["rollout"]["batch_size"], c["rollout"]["group_size"], c["train"]["mini_batches"]) == (64, 8, 2)
    assert c["rollout"]["sde"] == {"kind": "cps", "noise_level": 0.8} and c["rollout"]["eval_steps"] == 28
    assert c["train"]["timesteps"] == {"strategy": "window", "window": 3, "window_range": [0, 5]}
    assert c["iterations"] == 100
    # a key the script sets that digen has no equivalent for is named, not folded into a count
    assert "actor_rollout_ref.actor.fsdp_config.param_offload" in result.dropped
    assert "actor_rollout_ref.rollout.algo.sde_window_range" not in result.dropped


def test_dance_grpo_headline_script_equals_its_example():
    result = import_config("dance-grpo", str(DANCE))
    result.validate()
    diff, shared = _shared_differences(result.config, EXAMPLES / "dance-grpo-flux.yaml")
    assert diff == {} and len(shared) >= 25
    # 3 optimizer steps of a GPU's 12 samples; digen's whole-group steps take 2, and say so
    assert "--gradient_accumulation_steps" in result.dropped or result.config["train"].get("mini_batch_split")
    assert {"--shift", "--sampler_seed", "--allow_tf32"} <= set(result.dropped)


def test_an_unknown_peer_exits_2():
    r = CliRunner().invoke(app, ["import-config", "flow-grp", "x.py:y"])
    assert r.exit_code == 2 and "did you mean 'flow-grpo'" in r.output


def test_dance_grpo_lora_script_imports_as_lora_with_its_targets():
    """finetune_flux_grpo_8gpus_lora.sh runs fastvideo/train_grpo_flux_lora.py: a rank-128 LoRA
    on the attention projections at lr 3e-4, not a full fine-tune (the script's name is the only
    place the variant is written)."""
    result = import_config("dance-grpo", str(DANCE.parent / "finetune_flux_grpo_8gpus_lora.sh"))
    result.validate()
    c = result.config
    assert c["model"]["lora"] == {
        "enabled": True,
        "rank": 128,
        "alpha": 256,
        "dtype": "float32",
        "target_modules": ["to_k", "to_q", "to_v", "to_out.0"],
    }
    assert c["train"]["lr"] == 3e-4 and "fsdp" not in c["train"]
    full = import_config("dance-grpo", str(DANCE.parent / "finetune_flux_grpo_8gpus.sh"))
    full.validate()  # its --use_ema under FSDP: a sharded EMA, DanceGRPO's (train_grpo_flux.py l.866-867)
    assert full.config["model"]["lora"] == {"enabled": False} and full.config["train"]["fsdp"] is True
    assert full.config["train"]["ema"] == {
        "enabled": True,
        "decay": 0.995,
        "warmup": False,
        "update": "iteration",
    }
    assert "--use_ema" not in full.dropped


def test_lora_targets_are_the_recipe_s_own():
    """Flow-GRPO's FLUX and Qwen-Image scripts adapt 12 module types, feed-forwards included
    (train_flux.py l.411-424, train_qwenimage.py l.410-423); VeRL-Omni's examples list theirs."""
    flux = import_config("flow-grpo", f"{GRPO}:pickscore_flux").config["model"]["lora"]["target_modules"]
    assert len(flux) == 12 and {
        "ff.net.0.proj",
        "ff.net.2",
        "ff_context.net.0.proj",
        "ff_context.net.2",
    } <= set(flux)
    qwen = import_config("flow-grpo", f"{GRPO}:pickscore_qwenimage").config["model"]["lora"]["target_modules"]
    assert len(qwen) == 12 and {"img_mlp.net.2", "txt_mlp.net.0.proj"} <= set(qwen)
    sd3 = import_config("flow-grpo", f"{GRPO}:pickscore_sd3").config["model"]["lora"]["target_modules"]
    assert len(sd3) == 8 and all(t.startswith("attn.") for t in sd3)
    vo = import_config("verl-omni", str(VO / "qwen_image" / "run_qwen_image_ocr_lora.sh"))
    assert [t for t in vo.config["model"]["lora"]["target_modules"] if "mlp" in t] == [
        "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2"
    ]  # fmt: skip


@pytest.mark.parametrize(
    "script, algorithm",
    [
        ("grpoguard_trainer", "grpo-guard"),
        ("flowdppo_trainer", "flow-dppo"),
        ("flowgrpo_trainer", "flow-grpo-fast"),
    ],
)
def test_verl_omni_s_loss_mode_is_the_algorithm(script, algorithm):
    """GRPO-Guard's and Flow-DPPO's examples set model.algorithm=flow_grpo beside
    diffusion_loss.loss_mode: the loss is what they train (they used to import as flow-grpo)."""
    result = import_config("verl-omni", str(VO.parent / script / "qwen_image" / "run_qwen_image_ocr_lora.sh"))
    result.validate()
    train = result.config["train"]
    assert train["algorithm"] == algorithm
    assert train["timesteps"] == {"strategy": "window", "window": 2, "window_range": [0, 5]}
    if algorithm == "grpo-guard":
        assert train["clip_range"] == 2e-6
    if algorithm == "flow-dppo":
        assert train["flow_dppo"] == {"kl_threshold": 1e-5}


def test_verl_omni_s_mix_grpo_keeps_its_own_window():
    """model.algorithm=mix_grpo with Flow-GRPO's loss_mode is MixGRPO (its window, random)."""
    script = VO.parent / "mixgrpo_trainer" / "qwen_image" / "run_qwen_image_ocr_lora_mixgrpo.sh"
    result = import_config("verl-omni", str(script))
    result.validate()
    assert result.config["train"]["algorithm"] == "mix-grpo"
    assert result.config["train"]["mix_grpo"] == {"window": 2, "schedule": "random"}


def test_an_algorithm_digen_lacks_is_refused_naming_the_key():
    with pytest.raises(
        ConfigError, match=r"diffusion_loss.loss_mode=distill_kl is not an algorithm digen trains"
    ):
        import_config(
            "verl-omni", str(VO.parent / "diffusionopd_trainer" / "sd35" / "run_sd35_medium_ocr_distill.sh")
        )


GUARD = PEERS / "flow_grpo" / "config" / "grpo_guard.py"


@pytest.mark.parametrize(
    "recipe", ["general_ocr_sd3_rationorm", "pickscore_hps_sd3_ratio_norm", "geneval_sd3_rationorm"]
)
def test_flow_grpo_s_grpo_guard_recipes_import_as_grpo_guard(recipe):
    result = import_config("flow-grpo", f"{GUARD}:{recipe}")
    result.validate()
    assert result.config["train"]["algorithm"] == "grpo-guard"
    assert "train_sd3_GRPO_Guard.py" in result.source and "rationorm" not in result.dropped
    assert result.config["train"]["clip_range"] in (2e-6, 4e-6)


def test_videoalign_coefficients_weight_one_advantage_per_reward(tmp_path):
    """train_grpo_hunyuan.py's --vq_coef / --mq_coef (argparse defaults 1.0 / 0.0) weight one
    group advantage per reward: both rewards with their coefficients under
    ``train.multi_reward: per_reward``; both 0 trains nothing and is refused."""
    text = (DANCE.parent / "finetune_hunyuan_grpo.sh").read_text()
    both = tmp_path / "both.sh"
    both.write_text(text.replace("--mq_coef 0.0", "--mq_coef 0.5").replace("--vq_coef 1.0", "--vq_coef 0.8"))
    imported = import_config("dance-grpo", str(both))
    imported.validate()
    c = imported.config
    assert [(r["kwargs"]["name"], r["weight"]) for r in c["reward"]] == [
        ("videoalign_vq", 0.8),
        ("videoalign_mq", 0.5),
    ]
    assert c["train"]["multi_reward"] == "per_reward" and "MQ" in imported.placeholders["reward"]
    default = tmp_path / "default.sh"
    default.write_text(text.replace("--vq_coef 1.0 \\\n", "").replace("--mq_coef 0.0", ""))
    assert "vq_coef" not in default.read_text()
    assert import_config("dance-grpo", str(default)).config["reward"][0]["weight"] == 1.0
    zero = tmp_path / "zero.sh"
    zero.write_text(text.replace("--vq_coef 1.0", "--vq_coef 0"))
    with pytest.raises(ConfigError, match="--vq_coef and --mq_coef are both 0"):
        import_config("dance-grpo", str(zero))


def test_per_recipe_numbers_the_scripts_fix_in_code():
    """HunyuanVideo's hard-coded guidance 6018 (6.018 x 1000) and --t frames, Wan's --cfg_infer,
    the scripts digen has no family for, Flow-GRPO Wan's filter and its SDE that ignores
    noise_level, fp16 autocast said aloud."""
    hun = import_config("dance-grpo", str(DANCE.parent / "finetune_hunyuan_grpo.sh"))
    hun.validate()
    c = hun.config
    assert (c["rollout"]["guidance_scale"], c["model"]["num_frames"], c["rollout"]["shared_noise"]) == (
        6.018,
        53,
        True,
    )
    assert "--t" not in hun.dropped and "--bestofn" in hun.dropped
    # --use_videoalign --vq_coef 1.0 --mq_coef 0.0: DanceGRPO's per-reward advantages, the VQ term only
    assert not any("coef" in key for key in hun.dropped)
    assert c["train"]["multi_reward"] == "per_reward"
    assert [(r["kwargs"]["name"], r["weight"]) for r in c["reward"]] == [("videoalign_vq", 1.0)]
    wan = import_config("dance-grpo", str(DANCE.parent / "finetune_wan_2_1_grpo.sh")).config
    assert (wan["rollout"]["guidance_scale"], wan["model"]["num_frames"]) == (5.0, 1)
    for script, cause in [
        ("finetune_sd_grpo.sh", "Stable Diffusion v1"),
        ("finetune_skyreels_i2v.sh", "image-to-video"),
    ]:
        with pytest.raises(ConfigError, match=cause):
            import_config("dance-grpo", str(DANCE.parent / script))
    fg_wan = import_config("flow-grpo", f"{GRPO}:general_ocr_wan2_1")
    assert fg_wan.config["train"]["zero_advantage"] == "drop"  # train_wan2_1.py l.847's filter
    assert "sigma_min + (sigma_max - sigma_min) * sigma" in fg_wan.dropped["sample.noise_level"]
    sd3 = import_config("flow-grpo", f"{GRPO}:pickscore_sd3")
    assert (
        "GradScaler" in sd3.dropped["mixed_precision (fp16)"]
        and sd3.config["model"]["autocast"] == "bfloat16"
    )


VO_DPO = PEERS / "verl_omni" / "examples" / "dpo_trainer"


def test_verl_omni_online_dpo_imports_as_online_dpo_with_its_numbers():
    # numbers read from run_qwen_image_online_dpo_lora.sh
    result = import_config("verl-omni", str(VO_DPO / "qwen_image" / "run_qwen_image_online_dpo_lora.sh"))
    result.validate()
    c = result.config
    assert c["train"]["algorithm"] == "online-dpo" and c["train"]["online_dpo"] == {"beta": 100.0}
    assert (c["train"]["lr"], c["train"]["weight_decay"]) == (3e-4, 1e-4)
    assert (c["model"]["lora"]["rank"], c["model"]["lora"]["alpha"]) == (64, 128)
    assert (c["rollout"]["group_size"], c["rollout"]["batch_size"]) == (16, 32 * 16)
    # ppo_mini_batch_size 16 of 32 prompts: two steps, by whole groups (the loss pairs within a group)
    assert c["train"]["mini_batches"] == 2 and "mini_batch_split" not in c["train"]
    assert (c["iterations"], c["rollout"]["num_steps"], c["rollout"]["eval_steps"]) == (300, 35, 50)
    assert "sde" not in c["rollout"] and c["reward"] == [{"name": "ocr", "weight": 1.0}]


@pytest.mark.parametrize(
    "script, key",
    [
        ("sd35/run_sd35_medium_offline_dpo_lora.sh", "algorithm.sample_source=offline"),
        ("sd35/run_sd35_medium_offline_dpo_lora_npu.sh", "--config-name=offline_dpo_trainer"),
    ],
)
def test_verl_omni_offline_dpo_is_refused_in_one_line(script, key):
    with pytest.raises(ConfigError, match=key) as err:
        import_config("verl-omni", str(VO_DPO / script))
    assert "offline DPO" in str(err.value) and "\n" not in str(err.value)


def test_verl_omnis_sub_rewards_are_one_weighted_reward_each(tmp_path):
    """run_qwen_image_ocr_multi_reward.sh: MultiVisualRewardManager sums its
    reward.reward_functions weighted (verl_omni/reward_loop/reward_manager/multi.py l.150-188):
    one reward each with its weight, train.multi_reward: sum; another aggregation is refused."""
    script = (
        PEERS
        / "verl_omni"
        / "examples"
        / "flowgrpo_trainer"
        / "qwen_image"
        / "run_qwen_image_ocr_multi_reward.sh"
    )
    imported = import_config("verl-omni", str(script))
    imported.validate()
    c = imported.config
    assert [(r["kwargs"]["name"], r["weight"]) for r in c["reward"]] == [("ocr", 0.5), ("jpeg", 0.5)]
    assert c["train"]["multi_reward"] == "sum"
    assert not any(k.startswith("reward.reward_functions") for k in imported.dropped)
    generated = "verl_omni/trainer/config/_generated_diffusion_trainer.yaml"  # the importer's base, above
    (tmp_path / generated).parent.mkdir(parents=True)
    (tmp_path / generated).write_text((PEERS / "verl_omni" / generated).read_text())
    other = tmp_path / "examples" / "run_other_aggregation.sh"
    other.parent.mkdir()
    other.write_text(script.read_text().replace("reward.aggregation=weighted_sum", "reward.aggregation=mean"))
    with pytest.raises(ConfigError, match="reward.aggregation=mean"):
        import_config("verl-omni", str(other))
