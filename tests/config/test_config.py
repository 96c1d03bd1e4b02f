"""Config loading: every problem reported at once, with field, value and fix; exit code 2."""

from __future__ import annotations

import pytest
import yaml
from typer.testing import CliRunner

from digen.cli.main import app
from digen.config import build_config, dump_config, load_config, parse_overrides
from digen.errors import ConfigError
from tests.conftest import required


def test_defaults_and_overrides(tiny_sd3):
    cfg = build_config(
        required({"model": {"path": str(tiny_sd3)}}),
        ["rollout.group_size=8", "rollout.batch_size=16", "schedule.mode=digen"],
    )
    assert cfg.rollout.group_size == 8 and cfg.rollout.prompts_per_iteration == 2
    s = cfg.schedule.resolved()
    assert (s.gap, s.tsp, s.tag, s.max_staleness) == (True, True, True, 1)
    assert build_config(required({"model": {"path": str(tiny_sd3)}})).schedule.resolved().max_staleness == 0
    # the resolved config round-trips through config.yaml
    again = build_config(yaml.safe_load(dump_config(cfg)))
    assert again.model_dump(exclude={"source_dir", "schedule"}) == cfg.model_dump(
        exclude={"source_dir", "schedule"}
    )
    assert again.schedule == cfg.schedule.resolved()  # config.yaml holds the toggles resolved


def test_every_problem_at_once(tmp_path):
    bad = {
        "iterations": "many",
        "rollout": {"batch_size": 12, "group_size": 5},
        "train": {"clip_range": 0, "bogus": 1},
        "model": {"path": str(tmp_path / "nowhere")},
    }
    with pytest.raises(ConfigError) as err:
        build_config(bad)
    text = "\n".join(err.value.problems)
    assert "iterations ('many')" in text
    assert "train.clip_range (0)" in text
    assert "train.bogus: unknown key" in text
    # type errors first; the cross-field checks run on a valid schema
    with pytest.raises(ConfigError) as err:
        build_config(
            required(
                {"rollout": {"batch_size": 12, "group_size": 5}, "model": {"path": str(tmp_path / "nowhere")}}
            )
        )
    text = "\n".join(err.value.problems)
    assert "rollout.group_size (5) must divide rollout.batch_size (12)" in text
    assert "model.path" in text and "make-tiny-model" in text


def test_bad_overrides_and_yaml(tmp_path):
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_overrides(["rollout.group_size"])
    p = tmp_path / "bad.yaml"
    p.write_text("seed: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML at line"):
        load_config(p)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_cli_exit_code_2_lists_every_problem(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text(
        yaml.safe_dump(
            required(
                {
                    "rollout": {"batch_size": 12, "group_size": 5},
                    "train": {"kl_beta": 0.1},
                    "model": {"path": str(tmp_path / "none"), "lora": {"enabled": False}},
                }
            )
        )
    )
    result = CliRunner().invoke(app, ["train", str(p), "--out", str(tmp_path / "run")])
    assert result.exit_code == 2
    out = result.output
    assert "3 problems" in out or "problems" in out
    assert "group_size (5)" in out and "kl_beta" in out and "model.path" in out
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_model_configs_for_real_use_validate():
    from pathlib import Path

    files = sorted(Path("configs/models").glob("*.yaml"))
    assert len(files) == 5
    for f in files:
        cfg = load_config(f, check_paths=False)
        assert cfg.model.dtype == "bfloat16" and cfg.schedule.mode == "digen"


def test_model_path_prompts_and_reward_are_required_with_the_other_problems():
    with pytest.raises(ConfigError) as err:
        build_config({"iterations": "many", "model": {"resolution": 32}})
    problems = err.value.problems
    assert problems[0].startswith("iterations ('many')")  # reported with the other problems
    assert any(p.startswith("model.path is required: the local diffusers pipeline folder") for p in problems)
    assert any(p.startswith("prompts is required") for p in problems)
    assert any(p.startswith("reward is required") for p in problems)
    with pytest.raises(ConfigError, match="^model.path is required"):  # no model section at all
        build_config({"prompts": {"items": ["a"]}, "reward": [{"name": "brightness"}]})


def test_a_config_without_model_path_exits_2_and_makes_no_run_directory(tmp_path, monkeypatch):
    """Even run from a folder that holds the tiny model the README's first steps make."""
    (tmp_path / ".tiny" / "sd3").mkdir(parents=True)
    (tmp_path / ".tiny" / "sd3" / "model_index.json").write_text(
        '{"_class_name": "StableDiffusion3Pipeline"}'
    )
    cfg = tmp_path / "no-model.yaml"
    cfg.write_text(
        yaml.safe_dump({"prompts": {"items": ["a red square"]}, "reward": [{"name": "brightness"}]})
    )
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["train", str(cfg), "--out", "runs/x"])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "model.path is required" in lines[0]
    assert not (tmp_path / "runs").exists()


def test_an_unset_sequence_length_is_the_familys_and_refused_beyond_the_text_encoder(tiny_sd3):
    from digen.checks import model_problems

    cfg = build_config(required({"model": {"path": str(tiny_sd3)}}))
    assert cfg.model.max_sequence_length is None and cfg.model.device == "auto"
    (problem,) = model_problems(cfg)  # sd3's own 128 does not fit the tiny T5's 32: refused, not cut
    assert problem.startswith("model.max_sequence_length (unset: 128, the family's own, Flow-GRPO's")
    assert "set model.max_sequence_length=32 or less" in problem
    assert (
        model_problems(build_config(required({"model": {"path": str(tiny_sd3), "max_sequence_length": 32}})))
        == []
    )


def test_the_family_sequence_lengths_are_the_adapters_and_the_pipelines():
    import inspect

    import diffusers

    from digen.checks import FAMILY_SEQUENCE_LENGTH
    from digen.models.registry import FAMILIES

    for family in FAMILIES.values():
        (pipeline,) = family.pipelines
        length = FAMILY_SEQUENCE_LENGTH[pipeline][0]
        assert family.adapter_class().default_max_sequence_length == length, pipeline
        default = (
            inspect.signature(getattr(diffusers, pipeline).__call__).parameters["max_sequence_length"].default
        )
        assert length == (128 if pipeline == "StableDiffusion3Pipeline" else default), (
            pipeline
        )  # sd3: Flow-GRPO's


def test_precision_keys_validate():
    cfg = build_config(
        required(
            {
                "model": {
                    "text_encoder_dtype": "float16",
                    "autocast": "bfloat16",
                    "lora": {"dtype": "bfloat16"},
                }
            }
        ),
        check_paths=False,
    )
    assert (cfg.model.dtype, cfg.model.vae_dtype, cfg.model.lora.dtype) == ("float32", "float32", "bfloat16")
    with pytest.raises(ConfigError) as err:
        build_config(required({"model": {"autocast": "float16", "vae_dtype": "int8"}}), check_paths=False)
    assert sorted(p.split(" ")[0] for p in err.value.problems) == ["model.autocast", "model.vae_dtype"]
    with pytest.raises(ConfigError, match=r"model.autocast \(bfloat16\) with model.dtype float64"):
        build_config(required({"model": {"autocast": "bfloat16", "dtype": "float64"}}), check_paths=False)


@pytest.mark.parametrize(
    ("override", "said"),
    [
        (
            "rollout.batch_size=1000000000000",
            "rollout.batch_size (1000000000000): Input should be less than or equal to 65536",
        ),
        ("rollout.batch_size=1e12", "rollout.batch_size"),
        (
            "cluster.local.rollout_workers=100000",
            "cluster.local.rollout_workers (100000): Input should be less than or equal to 1024",
        ),
        (
            "rollout.num_steps=100000",
            "rollout.num_steps (100000): Input should be less than or equal to 1000",
        ),
        (
            "model.resolution=1000000",
            "model.resolution (1000000): Input should be less than or equal to 16384",
        ),
        (
            "iterations=100000000000",
            "iterations (100000000000): Input should be less than or equal to 10000000",
        ),
    ],
)
def test_absurd_sizes_are_one_line_at_load(tiny_sd3, override: str, said: str):
    """Limits no real run reaches (digen.config.MAX_*), refused before anything is planned."""
    with pytest.raises(ConfigError) as err:
        build_config(required({"model": {"path": str(tiny_sd3)}}), [override])
    assert len(err.value.problems) == 1 and said in err.value.problems[0], err.value.problems
    res = CliRunner().invoke(
        app, ["plan", str(_tiny_yaml()), "--set", f"model.path={tiny_sd3}", "--set", override]
    )
    assert res.exit_code == 2 and said in res.output and len(res.output.strip().splitlines()) == 1, res.output


def test_the_local_workers_together_are_bounded_too(tiny_sd3):
    sets = [f"cluster.local.{role}_workers=400" for role in ("rollout", "trainer", "reward")]
    with pytest.raises(ConfigError, match=r"cluster.local has 1200 workers .*: at most 1024 on one machine"):
        build_config(required({"model": {"path": str(tiny_sd3)}}), sets)
    build_config(required({"model": {"path": str(tiny_sd3)}}), sets[:2])  # 800: allowed


def _tiny_yaml():
    from tests.service.helpers import CONFIG

    return CONFIG


def test_ema_eval_and_export_need_an_ema(tiny_sd3):
    data = required({"model": {"path": str(tiny_sd3)}, "train": {"ema": {"eval": True, "export": True}}})
    with pytest.raises(ConfigError) as err:
        build_config(data)
    assert [p for p in err.value.problems if "train.ema." in p] == [
        "train.ema.eval (true) needs train.ema.enabled (false): there is no EMA to evaluate; "
        "set train.ema.enabled=true or train.ema.eval=false",
        "train.ema.export (true) needs train.ema.enabled (false): there is no EMA to export; "
        "set train.ema.enabled=true or train.ema.export=false",
    ]
    data["train"]["ema"]["enabled"] = True
    assert build_config(data).train.ema.eval
