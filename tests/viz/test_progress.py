"""The live display of ``digen train`` (digen.cli.progress.Progress): rich, json lines and quiet."""

from __future__ import annotations

import json

from digen.cli.progress import Progress

from ._runs import metrics_rows


def test_json_lines_and_announcements(capsys):
    rows = metrics_rows(2)
    with Progress(2, "json") as p:
        p({"event": "start", "dashboard": "http://127.0.0.1:8787/status", "roles": {"rollout-0": "rollout"}})
        for r in rows:
            p(r)
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert lines[0]["event"] == "start" and lines[1:] == rows


def test_quiet_prints_nothing(capsys):
    with Progress(2, "quiet") as p:
        for r in metrics_rows(2):
            p(r)
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_rich_status_counts_samples_and_shows_roles():
    p = Progress(3, "rich")
    with p:
        p({"event": "start", "roles": {"trainer-0": "trainer", "rollout-0": "rollout"}})
        rows = metrics_rows(2)
        for r in rows:
            p(r)
        lines = p.status_lines(rows[-1])
    assert lines[0].startswith("samples 16  reward 0.4100 ± 0.0500  8.0 samples/s  bubble 0.25  policy v2")
    assert lines[1] == "workers: rollout-0 [rollout]  trainer-0 [trainer]"
    # roles carried by a metrics row replace the announced ones (TAG changes them)
    p({**rows[-1], "iteration": 2, "roles": {"trainer-0": "trainer+gen"}})
    assert p.status_lines(rows[-1])[1] == "workers: trainer-0 [trainer+gen]"
    assert p.samples == 24


def test_rich_without_roles_shows_the_worker_count():
    p = Progress(1, "rich")
    assert p.status_lines({"workers": 2, "samples": 8})[1] == "workers: 2"


def test_a_resumed_run_says_so_on_the_console_and_in_its_log(tiny_sd3, tmp_path):
    """``digen train --resume`` of a run that did 1 iteration: the console (rich) and
    ``digen.log`` both say ``resumed from iteration 1/2 (checkpoint RUN/checkpoints/iter_0000)``."""
    import yaml
    from typer.testing import CliRunner

    from digen.cli.main import app
    from tests.conftest import small_config_data

    path, out = tmp_path / "job.yaml", tmp_path / "run"
    path.write_text(yaml.safe_dump(small_config_data(tiny_sd3, iterations=1)))
    assert (
        CliRunner().invoke(app, ["train", str(path), "--out", str(out), "--log-format", "quiet"]).exit_code
        == 0
    )
    res = CliRunner().invoke(
        app, ["train", str(path), "--out", str(out), "--resume", "--set", "iterations=2"]
    )
    assert res.exit_code == 0, res.output
    said = f"resumed from iteration 1/2 (checkpoint {out / 'checkpoints' / 'iter_0000'})"
    assert said in res.stderr
    assert said in (out / "digen.log").read_text()
    assert [r["iteration"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())] == [
        0,
        1,
    ]


def test_progress_within_an_iteration_counts_samples_generated_and_trained(small_config, tmp_path):
    """The reference loop reports, as each group is generated and each train task counts,
    where the iteration stands; the counts only grow, and the last report before each
    iteration's row has every sample generated and trained (no sample is dropped here)."""
    from digen.reference import run_reference

    seen: list[dict] = []
    run_reference(small_config(), tmp_path / "run", progress=seen.append)
    for k in range(2):
        within = [m for m in seen if m.get("event") == "progress" and m["iteration"] == k]
        row_at = next(i for i, m in enumerate(seen) if "event" not in m and m["iteration"] == k)
        assert seen.index(within[-1]) < row_at
        assert [m["generated"] for m in within] == [4, 8, 8, 8]  # 2 groups of 4, then 2 train tasks
        assert [m["trained"] for m in within] == [0, 0, 4, 8]
        assert {m["samples"] for m in within} == {8}


def test_rich_shows_the_iteration_in_progress_under_the_bar():
    p = Progress(70, "rich")
    with p:
        p({"event": "progress", "iteration": 4, "generated": 40, "trained": 16, "samples": 80})
        assert p._within == "iteration 5/70: generated 40/80 samples, trained 16/80"
        p(metrics_rows(1)[0])
        assert p._within == ""  # an iteration's row replaces it
