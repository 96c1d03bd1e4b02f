"""Reports: the Gantt PNG, the Markdown tables and the ``digen simulate`` command."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from typer.testing import CliRunner

from digen.cli.main import app
from digen.sim.driver import LADDER
from digen.sim.report import explain, markdown_results, plot_gantt, text_table
from digen.sim.study import SimSettings, run_study
from tests.sim.conftest import uniform_model

CATALOG = Path(__file__).resolve().parents[2] / "configs" / "sim" / "catalog.yaml"


def study():
    return run_study(uniform_model(workers=4, tasks=16), ["colocated", *LADDER], SimSettings(4, 1, 1))


def test_gantt_png_is_written_with_one_bar_per_task_part(tmp_path):
    st = study()
    out = tmp_path / "g.png"
    bars = plot_gantt([r.sim for r in st.results[:2]], out, title="t")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    colocated = st.results[0].sim
    lo, hi = colocated.step_ends[0], colocated.step_ends[1]
    in_window = [r for r in colocated.rows if r["end"] > lo and r["start"] < hi]
    assert bars >= len(in_window) > 0


def test_tables_list_every_mode_and_explain_the_speedup():
    st = study()
    text = text_table(st)
    assert all(f"| {m} |" in text for m in ["colocated", *LADDER])
    md = markdown_results([("w", "t", st)])
    assert md.count("\n") == 2 and "| w | t | 4 |" in md
    assert "of the bound" in explain(st)


def _small_config(tmp_path: Path) -> Path:
    p = tmp_path / "tiny_C.yaml"
    p.write_text(
        yaml.safe_dump(
            {
                "catalog": str(CATALOG),
                "workload": "flow-grpo-flux",
                "testbed": "C",
                "prompts": 4,
                "sim": {"iterations": 3, "warmup": 1, "neighbours": 0},
            }
        )
    )
    return p


def test_simulate_json_prints_one_object_per_mode(tmp_path):
    cfg = _small_config(tmp_path)
    gantt = tmp_path / "g.png"
    res = CliRunner().invoke(
        app,
        ["simulate", str(cfg), "--modes", "colocated,disaggregated,digen", "--json", "--gantt", str(gantt)],
    )
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout[res.stdout.index("[") :])
    assert [r["mode"] for r in rows] == ["colocated", "disaggregated", "digen"]
    assert all(
        {"s_per_iteration", "samples_per_s", "bubble_ratio", "speedup_vs_colocated", "fraction_of_bound"}
        <= set(r)
        for r in rows
    )
    assert gantt.exists()


def test_simulate_all_writes_the_markdown_results_table(tmp_path):
    _small_config(tmp_path)
    out = tmp_path / "results.md"
    res = CliRunner().invoke(
        app, ["simulate", str(tmp_path), "--all", "--modes", "colocated,digen", "--out", str(out)]
    )
    assert res.exit_code == 0, res.output
    text = out.read_text()
    assert "| flow-grpo-flux | C | 16 |" in text and "Why (from the simulation)" in text


def test_simulate_rejects_bad_input_with_exit_code_2(tmp_path):
    cfg = _small_config(tmp_path)
    assert CliRunner().invoke(app, ["simulate", str(cfg), "--modes", "nope"]).exit_code == 2
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"catalog": str(CATALOG), "workload": "nope", "testbed": "Z"}))
    res = CliRunner().invoke(app, ["simulate", str(bad), "--no-gantt"])
    assert res.exit_code == 2 and "workload (nope)" in res.output
