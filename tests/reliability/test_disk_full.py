"""A full disk: a write of a run file that fails with ENOSPC (the kernel's, from /dev/full, or
safetensors' error for it) ends the run with one line naming the path, the bytes needed and
the last intact checkpoint; no partial checkpoint is left; ``--resume`` continues. A run log
that cannot be written prints one warning, not a ``--- Logging error ---`` block per record.
(Too little space at the start: test_bad_input.py::test_too_little_disk_space_is_refused_before_anything_starts.)"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import yaml
from safetensors import SafetensorError
from typer.testing import CliRunner

from digen.cli.console import RunLog
from digen.cli.main import app
from tests.conftest import small_config_data


def train(cfg: Path, out: Path, *extra: str) -> tuple[int, list[str]]:
    res = CliRunner().invoke(app, ["train", str(cfg), "--out", str(out), "--log-format", "quiet", *extra])
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    return res.exit_code, [ln for ln in res.stderr.splitlines() if ln.strip()]


def config(tmp_path: Path, tiny_sd3: Path, **sections) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(small_config_data(tiny_sd3, **sections)))
    return path


def test_a_full_disk_mid_checkpoint_names_the_path_and_the_last_intact_checkpoint(
    tiny_sd3: Path, tmp_path: Path, monkeypatch
):
    """The second checkpoint's write fails as safetensors fails on a full disk (the error
    text it raises for ENOSPC); then --resume, with space again, finishes the run."""
    import digen.optim

    real = digen.optim.save_file
    calls = {"n": 0}

    def full_on_second_checkpoint(tensors, filename, *args, **kwargs):
        if "iter_0001" in str(filename):
            calls["n"] += 1
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(digen.optim, "save_file", full_on_second_checkpoint)
    cfg = config(tmp_path, tiny_sd3, iterations=3)
    out = tmp_path / "run"
    code, lines = train(cfg, out)
    assert code == 1 and len(lines) == 1, lines
    line = lines[0]
    assert line.startswith(
        f"error: the disk is full: writing {out / 'checkpoints' / 'iter_0001.tmp'} needed "
    )
    assert " bytes (" in line and "free;" in line
    assert f"the last intact checkpoint is {out / 'checkpoints' / 'iter_0000'}" in line and "--resume" in line
    assert calls["n"] == 1 and not (out / "checkpoints" / "iter_0001.tmp").exists()

    monkeypatch.setattr(digen.optim, "save_file", real)
    code, lines = train(cfg, out, "--resume")
    assert code == 0, lines
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in rows] == [0, 1, 2]


def test_a_full_disk_writing_a_log_row_is_one_line(tiny_sd3: Path, tmp_path: Path):
    """The kernel's ENOSPC: timeline.jsonl is /dev/full (every write fails with errno 28)."""
    out = tmp_path / "run"
    out.mkdir()
    os.symlink("/dev/full", out / "timeline.jsonl")
    code, lines = train(config(tmp_path, tiny_sd3, iterations=2), out)
    assert code == 1 and len(lines) == 1, lines
    assert lines[0].startswith(f"error: the disk is full: writing {out / 'timeline.jsonl'} needed ")
    assert "no checkpoint was written yet: free some space and rerun" in lines[0]


def test_a_run_log_on_a_full_disk_warns_once(tmp_path: Path, capfd):
    os.symlink("/dev/full", tmp_path / "digen.log")
    handler = RunLog(tmp_path / "digen.log")
    handler.open()
    for i in range(5):
        handler.emit(logging.LogRecord("digen", logging.INFO, __file__, 1, "record %d", (i,), None))
    handler.close()
    err = capfd.readouterr().err
    assert "Logging error" not in err and "Traceback" not in err
    assert err.count("cannot be written") == 1 and "No space left on device" in err


@pytest.mark.parametrize("errno_text", ["No space left on device (os error 28)"])
def test_disk_full_errors_are_recognised(errno_text):
    import errno

    from digen.rundir import is_disk_full

    assert is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert is_disk_full(SafetensorError(f"Error while serializing: I/O error: {errno_text}"))
    assert not is_disk_full(OSError(errno.EACCES, "Permission denied"))
