"""The command line as a peer's user meets it: ``digen --version``, flags shown without a type,
a Hydra-style ``key=value`` answered with ``--set``, tables that fit the terminal and are
never cut in a pipe, progress for the long commands, config names checked with the config,
and a ``--resume`` with nothing to run refused."""

from __future__ import annotations

import io
import json
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml
from rich.console import Console
from rich.table import Table
from typer.testing import CliRunner

from digen.cli.app import hydra_argument
from digen.cli.main import app
from tests.conftest import small_config_data

ROOT = Path(__file__).resolve().parents[2]
WIDE = {"COLUMNS": "200"}  # one line per option in --help


def cli(*args: object, env: dict | None = None):
    return CliRunner().invoke(app, [str(a) for a in args], env=env)


def help_rows(*command: str) -> dict[str, str]:
    """``--help``'s option rows of ``command``, by their first option name."""
    res = cli(*command, "--help", env=WIDE)
    assert res.exit_code == 0, res.output
    rows = {}
    for line in res.stdout.splitlines():
        cells = line.strip("│ ").split()
        if cells and cells[0].startswith("--"):
            rows[cells[0]] = line
    return rows


def test_version_prints_the_installed_package_version():
    res = cli("--version")
    assert res.exit_code == 0
    assert res.stdout.strip() == f"digen {version('digen')}"


@pytest.mark.parametrize("command", [(), ("train",), ("submit",), ("simulate",), ("bench",)])
def test_flags_show_no_type_and_options_keep_theirs(command):
    rows = help_rows(*command)
    flags = [r for name, r in rows.items() if name in ("--help", "--version", "--resume", "--wait", "--json")]
    assert flags, rows
    for row in flags:
        assert "<bool>" not in row, row
    if command == ("train",):
        assert "<path>" in rows["--out"] and "<bool>" not in rows["--verbose"]


def test_a_hydra_style_argument_is_one_line_suggesting_set(tmp_path):
    res = cli("train", tmp_path / "x.yaml", "iterations=3")
    assert res.exit_code == 2
    (line,) = res.output.strip().splitlines()
    assert "iterations=3 is not an argument of digen train: did you mean --set iterations=3?" in line
    res = cli("submit", tmp_path / "x.yaml", "train.lr=1e-4", "--wait")
    assert res.exit_code == 2 and "did you mean --set train.lr=1e-4?" in res.output
    # as an option's value it is no mistake: the command goes on (to the missing file)
    res = cli("train", tmp_path / "x.yaml", "--set", "iterations=3")
    assert res.exit_code == 2 and "--set iterations" not in res.output and "does not exist" in res.output


def test_hydra_argument_skips_option_values_and_what_follows_double_dash():
    opts = {"--set", "--out"}
    assert hydra_argument(["cfg.yaml", "rollout.group_size=4"], opts) == "rollout.group_size=4"
    assert hydra_argument(["cfg.yaml", "--set", "a.b=1", "--out", "x=y"], opts) is None
    assert hydra_argument(["cfg.yaml", "--set=a=1", "runs/a=b"], opts) is None
    assert hydra_argument(["--", "a=1"], opts) is None


def _wide_table() -> tuple[Table, str, str]:
    job, path = "job-" + "0123456789abcdef" * 3, "/runs/" + "deep/" * 30 + "run"
    table = Table(box=None)
    table.add_column("JOB", no_wrap=True)
    table.add_column("RUN DIR", overflow="fold")
    table.add_row(job, path)
    return table, job, path


def test_a_table_in_a_pipe_cuts_no_job_id_or_path(capsys):
    from digen.cli.app import print_table

    table, job, path = _wide_table()
    print_table(table)
    text = capsys.readouterr().out
    assert job in text and path in text and "…" not in text


def test_a_table_on_a_terminal_fits_its_width(monkeypatch):
    import digen.cli.app

    screen = io.StringIO()
    monkeypatch.setattr(
        digen.cli.app, "out", Console(file=screen, force_terminal=True, width=60, color_system=None)
    )
    table, _, _ = _wide_table()
    digen.cli.app.print_table(table)
    lines = screen.getvalue().splitlines()
    assert len(lines) > 1 and max(len(line) for line in lines) <= 60


def test_algorithms_prints_every_name_whole_and_as_json():
    from digen.config import ALGORITHM_NAMES

    res = cli("algorithms")
    assert res.exit_code == 0
    names = [line.split()[0] for line in res.stdout.splitlines()[1:] if line.strip()]
    assert [n for n in names if n in ALGORITHM_NAMES] == list(ALGORITHM_NAMES)
    res = cli("algorithms", "--json")
    assert [a["name"] for a in json.loads(res.stdout)] == list(ALGORITHM_NAMES)


@pytest.mark.slow
def test_the_tables_of_names_are_the_registries():
    """The torch-free tables the config loader checks names against (digen.config) list
    exactly what the registries, which import torch, hold: read in a fresh process, since
    other tests register rewards of their own in this one."""
    import json
    import subprocess
    import sys

    from digen.config import ALGORITHM_NAMES, REWARD_NAMES

    probe = (
        "import json, digen.rewards\n"
        "from digen.algos import registry as algos\n"
        "from digen.rewards import registry as rewards\n"
        "print(json.dumps([list(algos.available()), list(rewards.available())]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True
    )
    algos, rewards = json.loads(out.stdout.strip().splitlines()[-1])
    assert tuple(algos) == ALGORITHM_NAMES
    assert tuple(rewards) == REWARD_NAMES


def test_misspelt_names_come_with_the_configs_other_problems_before_anything_starts(tmp_path):
    data = small_config_data(
        tmp_path / "no-model", schedule={"mode": "digen"}, train__algorithm="flow-grp", rollout__group_size=3
    )
    data["reward"] = [{"name": "brightnes"}]
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    res = cli("train", path, "--out", tmp_path / "run")
    assert res.exit_code == 2
    text = res.output
    assert "4 problems" in text
    assert "no-model" in text  # the missing model folder, with the rest
    assert "rollout.group_size (3) must divide rollout.batch_size (8)" in text
    assert "reward 'brightnes' does not exist; did you mean 'brightness'?" in text
    assert "train.algorithm ('flow-grp') is not a registered algorithm; did you mean 'flow-grpo'?" in text
    assert not (tmp_path / "run").exists()  # nothing started, nothing written


@pytest.mark.slow
def test_simulate_says_each_mode_as_it_starts_before_its_result():
    res = cli("simulate", ROOT / "configs" / "sim" / "flux_A.yaml", "--modes", "colocated-digen", "--json")
    assert res.exit_code == 0, res.output
    steps = [line for line in res.stderr.splitlines() if ": step " in line]
    assert steps == [
        "simulate flow-grpo-flux @ A: step 1/2 colocated",
        "simulate flow-grpo-flux @ A: step 2/2 colocated-digen",
    ]
    assert [row["mode"] for row in json.loads(res.stdout)] == ["colocated-digen"]


def test_run_study_reports_each_mode_before_simulating_it():
    from digen.sim.catalog import load_sim_config
    from digen.sim.study import run_study

    setup = load_sim_config(ROOT / "configs" / "sim" / "flux_A.yaml")
    seen: list[str] = []
    study = run_study(setup.cost, ["colocated-digen"], setup.settings, progress=seen.append)
    assert seen == ["colocated", "colocated-digen"]
    assert [r.mode for r in study.results] == ["colocated-digen"]


def test_steps_print_a_line_per_step_in_a_log(capsys):
    from digen.cli.progress import Steps

    with Steps("bench", 2) as steps:
        steps.start("round 1/1 reference")
        steps.start("round 1/1 digen")
        steps.start("TSP micro-benchmark")  # more steps than announced: the total grows
    assert capsys.readouterr().err.splitlines() == [
        "bench: step 1/2 round 1/1 reference",
        "bench: step 2/2 round 1/1 digen",
        "bench: step 3/3 TSP micro-benchmark",
    ]


def _checkpointed_run(root: Path, last: int) -> Path:
    ckpt = root / "checkpoints" / f"iter_{last:04d}"
    ckpt.mkdir(parents=True)
    (ckpt / "state.json").write_text(json.dumps({"iteration": last, "version": last + 1}))
    return root


def test_resume_to_a_reached_target_is_a_problem(tmp_path):
    from digen.checks import run_dir_problems

    run = _checkpointed_run(tmp_path / "run", last=2)  # 3 iterations done
    for target in (2, 3):
        (problem,) = run_dir_problems(run, True, iterations=target)
        assert f"has completed 3 iterations (checkpoint iter_0002), and iterations is {target}" in problem
        assert "--set iterations=4" in problem
    assert run_dir_problems(run, True, iterations=4) == []
    assert run_dir_problems(run, False, iterations=2) == []  # a fresh run: RunDir refuses it itself


def test_train_resume_to_a_reached_target_exits_2_with_one_line(tiny_sd3, tmp_path):
    run = _checkpointed_run(tmp_path / "run", last=1)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(small_config_data(tiny_sd3)))  # iterations: 2
    res = cli("train", path, "--resume", "--out", run, "--log-format", "quiet")
    assert res.exit_code == 2, res.output
    (line,) = res.output.strip().splitlines()
    assert "has completed 2 iterations" in line and "nothing to run" in line


def test_digen_log_holds_a_progress_line_per_iteration_in_reference_mode(tiny_sd3, tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(small_config_data(tiny_sd3, output={"plots": False})))
    res = cli("train", path, "--out", tmp_path / "run", "--log-format", "json")
    assert res.exit_code == 0, res.output
    lines = (tmp_path / "run" / "digen.log").read_text().splitlines()
    progress = [line.split("digen.progress: ", 1)[1] for line in lines if "digen.progress: " in line]
    assert [p.split("  ")[0] for p in progress] == ["iteration 1/2", "iteration 2/2"], lines
    assert all(" reward " in p and " samples/s " in p for p in progress)
    assert "digen.progress" not in res.stderr  # the console shows the display, not the log lines


@pytest.mark.slow
def test_simulate_all_prints_json_per_config_with_a_step_per_mode(tmp_path):
    import shutil

    for name in ("flux_A.yaml", "catalog.yaml"):
        shutil.copy(ROOT / "configs" / "sim" / name, tmp_path / name)
    res = cli("simulate", tmp_path, "--all", "--modes", "colocated", "--json")
    assert res.exit_code == 0, res.output
    (row,) = json.loads(res.stdout)
    assert (row["workload"], row["testbed"]) == ("flow-grpo-flux", "A")
    assert [m["mode"] for m in row["modes"]] == ["colocated", "digen", "colocated-digen"]
    steps = [line.split(": step ")[1] for line in res.stderr.splitlines() if ": step " in line]
    assert steps == [f"{i}/3 flow-grpo-flux @ A {m['mode']}" for i, m in enumerate(row["modes"], 1)]


def test_algorithms_in_a_pipe_cut_no_path():
    """Piped, a long path in a folded column stays whole (Rich folded it at the column's width)."""
    res = cli("algorithms")
    assert res.exit_code == 0
    assert "flow_grpo/diffusers_patch/sd3_sde_with_logprob.py" in res.stdout


def test_help_summaries_are_whole_sentences_and_show_no_python_types():
    """The command list wraps each summary at the terminal, not where its docstring's source
    wraps; a repeatable option shows what one value is, not ``<list[str]>``; cancel says the
    iteration in progress is lost."""
    res = cli("--help", env={"COLUMNS": "400"})
    line = next(ln for ln in res.stdout.splitlines() if "make-tiny-model" in ln)
    assert "--layers/--heads/--head-dim make an sd3 transformer" in line
    for command in ("train", "submit", "bench", "certs", "worker"):
        text = cli(command, "--help", env=WIDE).stdout
        assert "list[" not in text, text
    assert "<KEY=VALUE>" in help_rows("train")["--set"]
    cancel = " ".join(cli("cancel", "--help", env=WIDE).stdout.split())
    assert "the iteration in progress is lost" in cancel and "after a checkpoint" not in cancel
