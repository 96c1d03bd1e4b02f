"""timeline.png and rewards.png: sizes, one lane per worker, every timeline row drawn."""

from __future__ import annotations

import io
import json

import numpy as np
from PIL import Image

from digen.plots import KIND_COLORS, plot_rewards, plot_timeline, staleness, worker_lanes, write_run_plots

from ._runs import metrics_rows, timeline_rows, write_run


def _pixels_near(img: Image.Image, hex_color: str, tol: int = 12) -> int:
    rgb = np.asarray(img.convert("RGB")).astype(int)
    target = np.array([int(hex_color[i : i + 2], 16) for i in (1, 3, 5)])
    return int((np.abs(rgb - target).max(axis=-1) <= tol).sum())


def test_timeline_draws_every_task_on_its_workers_lane(tmp_path):
    rows = timeline_rows(iterations=3)
    drawn = plot_timeline(rows, tmp_path / "timeline.png")
    assert drawn.bars == len(rows)
    per_worker = {
        w: sum(1 for r in rows if r["worker"] == w) for w in ("rollout-0", "trainer-0", "controller")
    }
    assert drawn.bars_per_lane == per_worker
    # one lane per worker, labelled with its role and GPU type, rollout first, controller last
    assert drawn.lanes == [
        "rollout-0\nrollout · h100",
        "trainer-0\ntrainer · l40s",
        "controller\ncontroller · cpu",
    ]
    # rollout rows of iterations >= 1 were generated with the previous version: hatched
    assert drawn.stale_bars == sum(1 for r in rows if staleness(r) > 0) == 12
    img = Image.open(tmp_path / "timeline.png")
    assert img.format == "PNG" and img.width == 1200 and img.height >= 250
    assert _pixels_near(img, KIND_COLORS["train"]) > 500  # the train bars are really there


def test_timeline_with_a_long_warmup_adds_a_zoom_panel_and_keeps_the_count(tmp_path):
    rows = timeline_rows(iterations=3)
    # iteration 0 starts with 30 s of model loading on both workers
    rows += [
        {**rows[0], "kind": "sync", "start": 970.0, "end": 1000.0},
        {**rows[6], "kind": "sync", "start": 970.0, "end": 1000.0},
    ]
    plain = Image.open(io.BytesIO(_png(timeline_rows(iterations=3))))
    drawn = plot_timeline(rows, tmp_path / "t.png")
    assert drawn.bars == len(rows)
    assert Image.open(tmp_path / "t.png").height > plain.height * 1.5


def _png(rows) -> bytes:
    buf = io.BytesIO()
    plot_timeline(rows, buf)
    return buf.getvalue()


def test_worker_lanes_name_every_role_a_worker_ran():
    rows = timeline_rows(iterations=1)
    rows.append({**rows[-4], "role": "trainer+gen"})  # a TAG generation on the trainer
    lanes = dict(worker_lanes(rows))
    assert lanes["trainer-0"] == "trainer-0\ntrainer/trainer+gen · l40s"


def test_a_sequence_parallel_replica_is_one_lane_naming_its_ranks():
    gen = {"role": "rollout", "gpu_type": "h100", "kind": "gen", "iteration": 0, "version": 0}
    rows = [
        {**gen, "worker": "r0", "start": 0.0, "end": 1.0, "sp_degree": 2, "ranks": ["r0", "r1"]},
        {**gen, "worker": "r2", "start": 0.0, "end": 1.0},  # a d=1 worker beside it
    ]
    assert worker_lanes(rows) == [("r0", "r0 + r1 (sp)\nrollout · h100"), ("r2", "r2\nrollout · h100")]


def test_rewards_png(tmp_path):
    rows = metrics_rows(iterations=6)
    assert plot_rewards(list(reversed(rows)), tmp_path / "rewards.png") == 6
    img = Image.open(tmp_path / "rewards.png")
    assert img.format == "PNG" and img.size == (800, 600)
    assert _pixels_near(img, "#1f77b4") > 100  # the reward line
    assert _pixels_near(img, "#ff7f0e") > 20  # the clip fraction line


def test_write_run_plots_reads_the_run_directory(tmp_path):
    run = write_run(tmp_path / "run")
    written = write_run_plots(run)
    assert sorted(p.name for p in written) == ["rewards.png", "timeline.png"]
    n_rows = len((run / "timeline.jsonl").read_text().splitlines())
    assert n_rows == len(timeline_rows())
    assert all(Image.open(p).format == "PNG" for p in written)


def test_write_run_plots_skips_empty_files(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps(metrics_rows(1)[0]) + "\n")
    assert [p.name for p in write_run_plots(tmp_path)] == ["rewards.png"]
