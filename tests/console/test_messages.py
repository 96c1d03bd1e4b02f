"""What the console shows when a run fails: one line per failure, as text (brackets in a
message are not Rich markup), naming the log file; the traceback of an unexpected error goes
to RUN_DIR/digen.log (``--verbose`` prints it)."""

from __future__ import annotations

from pathlib import Path

import yaml
from typer.testing import CliRunner

from digen.cli.main import app
from tests.conftest import small_config_data
from tests.reliability.reward_servers import RewardServer


def config(tmp_path: Path, tiny_sd3: Path, **sections) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(small_config_data(tiny_sd3, iterations=1, **sections)))
    return path


def train(*args: str) -> tuple[int, list[str]]:
    res = CliRunner().invoke(app, ["train", *args, "--log-format", "quiet"])
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    return res.exit_code, [ln for ln in res.stderr.splitlines() if ln.strip()]


def test_brackets_in_a_message_are_printed_as_they_are(tiny_sd3: Path, tmp_path: Path):
    with RewardServer("bad") as server:
        cfg = config(
            tmp_path, tiny_sd3, reward=[{"name": "http", "kwargs": {"url": server.url, "retries": 1}}]
        )
        code, lines = train(str(cfg), "--out", str(tmp_path / "run"))
    assert code == 1 and len(lines) == 1, lines
    assert f"reward server {server.url} returned no 'scores' list" in lines[0]
    assert 'the server must answer {"scores": [one float per sample]}' in lines[0]
    log = tmp_path / "run" / "digen.log"
    assert lines[0].endswith(f"(log: {log})") and log.exists()  # a failed run names its log


def test_an_unexpected_error_is_one_line_and_its_traceback_is_in_the_log(
    tiny_sd3: Path, tmp_path: Path, monkeypatch
):
    import digen.reference

    def broken(cfg):
        def score(images, prompts):
            raise ZeroDivisionError("a reward bug [line 3]")

        return score

    monkeypatch.setattr(digen.reference, "build_reward", broken)
    out = tmp_path / "run"
    code, lines = train(str(config(tmp_path, tiny_sd3)), "--out", str(out))
    assert code == 1 and len(lines) == 1, lines
    assert lines[0] == (
        f"error: ZeroDivisionError: a reward bug [line 3]; the traceback is in {out / 'digen.log'} "
        "(--verbose prints it)"
    )
    log = (out / "digen.log").read_text()
    assert "Traceback (most recent call last)" in log and "ZeroDivisionError: a reward bug [line 3]" in log

    code, lines = train(str(config(tmp_path, tiny_sd3)), "--out", str(tmp_path / "run2"), "--verbose")
    text = "\n".join(lines)
    assert code == 1 and "Traceback (most recent call last)" in text and "the traceback is above" in lines[-1]
