"""The ``digen`` entry point (digen.cli.main): one Typer app (digen.cli.app) that every command module
registers on, whether run as the ``digen`` script or as ``python -m digen.cli.main``."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import typer.main

from tests.conftest import DIGEN

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = [
    "train",
    "make-tiny-model",
    "reward-server",
    "algorithms",
    "bench",
    "report",
    "export",
    "submit",
    "serve",
    "status",
    "logs",
    "cancel",
    "worker",
    "certs",
    "simulate",
    "sp-bench",
    "plan",
    "doctor",
    "import-config",
]


def test_the_script_sees_every_command_once_on_the_shared_app():
    import digen.cli.app
    from digen.cli.main import app

    assert app is digen.cli.app.app
    assert list(typer.main.get_command(app).commands) == COMMANDS


@pytest.mark.slow
def test_python_m_lists_the_same_commands_in_the_same_order():
    env = {**os.environ, "COLUMNS": "400"}  # one line per command
    r = subprocess.run(
        [*DIGEN, "--help"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    rows = [line.split() for line in r.stdout.splitlines() if line.startswith("│ ")]
    assert [row[1] for row in rows if row[1] in COMMANDS] == COMMANDS


def test_bad_input_in_a_command_module_is_one_red_line_and_exit_2(tmp_path):
    from typer.testing import CliRunner

    from digen.cli.main import app

    res = CliRunner().invoke(app, ["report", str(tmp_path / "missing")])
    assert res.exit_code == 2
    (line,) = res.output.strip().splitlines()
    assert f"RUN_DIR ({tmp_path / 'missing'}) is not a folder" in line
