"""``digen train`` reports every problem of its input in one report before anything starts:
the config's own (keys, types, cross-checks, names), ``--log-format`` and the embedded
cluster's placement on this machine's GPUs (``cli/train.py``, ``_checked``)."""

from __future__ import annotations

from pathlib import Path

import yaml
from typer.testing import CliRunner

from digen.cli.main import app
from tests.conftest import small_config_data


def train(cfg: Path, out: Path, log_format: str) -> tuple[int, list[str]]:
    res = CliRunner().invoke(app, ["train", str(cfg), "--out", str(out), "--log-format", log_format])
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    return res.exit_code, [ln.strip() for ln in res.stderr.splitlines() if ln.strip()]


def test_log_format_placement_and_config_problems_are_one_report(tiny_sd3: Path, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("DIGEN_FAKE_GPUS", "2xh100")  # GPUs 0 and 1
    data = small_config_data(
        tiny_sd3,
        rollout__batch_size=10,  # a cross-check: group_size 4 does not divide it
        schedule__mode="digen",
        cluster={"local": {"rollout_workers": 1, "trainer_workers": 1, "gpus": [0, 5]}},
    )
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump(data))
    out = tmp_path / "run"
    code, lines = train(cfg, out, "fancy")
    assert code == 2, lines
    assert lines[0] == "error: 3 problems:", lines
    problems = "\n".join(lines[1:])
    assert len(lines) == 4, lines
    assert "--log-format (fancy) must be rich, json or quiet" in problems
    assert "rollout.group_size (4) must divide rollout.batch_size (10)" in problems
    assert "cluster.local.gpus lists GPU 5 but the GPUs here are: 0, 1" in problems
    assert not out.exists()  # nothing started: no run directory, no log


def test_a_placement_problem_alone_still_exits_2_before_the_run(tiny_sd3: Path, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("DIGEN_FAKE_GPUS", "1xh100")
    data = small_config_data(
        tiny_sd3, schedule__mode="digen", cluster={"local": {"gpus": [0], "rollout_workers": 3}}
    )
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump(data))
    out = tmp_path / "run"
    code, lines = train(cfg, out, "quiet")
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    assert not out.exists()
