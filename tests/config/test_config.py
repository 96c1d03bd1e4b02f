"""Config loading: every problem reported at once, with field, value and fix; exit code 2."""

from __future__ import annotations

import pytest
import yaml
from typer.testing import CliRunner

from cli.main import app
from digen.config import build_config, dump_config, load_config, parse_overrides
from digen.errors import ConfigError


def test_defaults_and_overrides(tiny_sd3):
    cfg = build_config(
        {"model": {"path": str(tiny_sd3)}},
        ["rollout.group_size=8", "rollout.batch_size=16", "schedule.mode=digen"],
    )
    assert cfg.rollout.group_size == 8 and cfg.rollout.prompts_per_iteration == 2
    s = cfg.schedule.resolved()
    assert (s.gap, s.tsp, s.tag, s.max_staleness) == (True, True, True, 1)
    assert build_config({"model": {"path": str(tiny_sd3)}}).schedule.resolved().max_staleness == 0
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
            {"rollout": {"batch_size": 12, "group_size": 5}, "model": {"path": str(tmp_path / "nowhere")}}
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
            {
                "rollout": {"batch_size": 12, "group_size": 5},
                "train": {"kl_beta": 0.1},
                "model": {"path": str(tmp_path / "none"), "lora": {"enabled": False}},
            }
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
