"""Held-out evaluation's outputs: the grid, the report section, logger scalars, bench cost."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from digen.bench import RunRecord, eval_cost, markdown_table, mode_config, parse_modes
from digen.config import build_config
from digen.evaluation import EvalBook, EvalResult, EvalTask, eval_metrics, progress_row, write_evaluation
from digen.loggers import namespaced
from digen.run_report import render_report
from digen.rundir import RunDir
from digen.viz import image_cells
from tests.conftest import required

from ._runs import write_run


def _book(iteration: int = 1) -> EvalBook:
    book = EvalBook(iteration, iteration + 1, 2)
    for c, (lo, hi) in enumerate(((0, 3), (3, 4))):
        idx = tuple(range(lo, hi))
        images = image_cells(torch.full((len(idx), 3, 16, 16), 40 * (c + 1), dtype=torch.uint8))
        scores = {"reward": [0.1 * i for i in idx], "brightness": [0.2 * i for i in idx]}
        book.add(
            EvalResult(
                EvalTask(iteration, c, iteration + 1, idx, tuple(f"p{i}" for i in idx)), images, scores
            )
        )
    return book


def test_write_evaluation_appends_the_row_and_draws_the_grid(tmp_path):
    run = RunDir(tmp_path / "run", build_config(required({}), check_paths=False))
    row = write_evaluation(run, _book())
    lines = (tmp_path / "run" / "eval.jsonl").read_text().splitlines()
    assert [json.loads(x)["iteration"] for x in lines] == [1]
    assert row["num_prompts"] == 4 and row["brightness_mean"] == pytest.approx(0.3)
    grid = Image.open(tmp_path / "run" / "eval" / "iter_0001.png")
    assert grid.width >= 4 * 16 and grid.height > 16


def test_report_shows_the_evaluations(tmp_path):
    root = write_run(tmp_path / "run")
    run = RunDir(root, build_config(required({}), check_paths=False), resume=True)
    write_evaluation(run, _book(1))
    page = render_report(root)
    assert "Held-out evaluation" in page and "brightness" in page
    assert "0.3 ± 0.2236" in page  # brightness mean ± std of 0, 0.2, 0.4, 0.6


def test_eval_scalars_are_namespaced_for_the_loggers():
    flat = namespaced(eval_metrics(progress_row(_book().row())))
    assert flat["eval/brightness_mean"] == pytest.approx(0.3)
    assert flat["eval/policy_version"] == 2.0 and flat["eval/num_prompts"] == 4.0
    assert not any("scores" in k or k.endswith("iteration") for k in flat)


def test_bench_eval_toggle_and_cost(tmp_path):
    assert parse_modes("digen+eval,digen-eval") == ["digen+eval", "digen-eval"]
    cfg = build_config(
        required(
            {"iterations": 4, "eval": {"every": 2}, "prompts": {"items": ["a", "b"], "test_file": "t.txt"}}
        ),
        check_paths=False,
    )
    assert mode_config(cfg, "digen+eval").eval.every == 2
    assert mode_config(cfg, "digen-eval").eval.every == 0
    assert (
        mode_config(
            cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"every": 0})}), "digen+eval"
        ).eval.every
        == 1
    )
    run = RunDir(tmp_path / "run", cfg)
    write_evaluation(run, _book(1))
    tl = [
        {"kind": "eval", "start": 1.0, "end": 1.5},
        {"kind": "eval", "start": 2.0, "end": 2.25},
        {"kind": "gen", "start": 0.0, "end": 9.0},
    ]
    cost = eval_cost([RunRecord("digen+eval", 0, tmp_path / "run", [], tl, True)])
    assert {k: cost[k] for k in ("evaluations", "eval_worker_s")} == {
        "evaluations": 1.0,
        "eval_worker_s": 0.75,
    }
    assert cost["eval_overtakes"] == 0 and cost["eval_wait_s"] == 0  # no task was released during them
    md = markdown_table(
        [
            {
                "mode": "digen+eval",
                "workers": 2,
                "s_per_iteration": 1.0,
                "samples_per_s": 1.0,
                "bubble_ratio": 0.1,
                "bubble_ratio_by_role": {},
                "speedup_vs_colocated": None,
                "speedup_vs_disaggregated": None,
                "bound_samples_per_s": 2.0,
                "fraction_of_bound": 0.5,
                "per_worker": [],
                **cost,
            }
        ],
        [],
    )
    # evaluations, eval worker-s, in/outside bubbles, wait caused, longest wait/task, overtakes, s/iteration
    assert "| digen+eval | 1 | 0.75 | 0.00 | 0.00 | 0.00 | 0.00 / 0.00 | 0 | 1.000 | n/a |" in md
