"""scripts/gpu_check.py, the device check, on a machine without a GPU: its plan fits 8
minutes, the CUDA steps are skipped naming why, a step past its limit is ended, and the
summary is written."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"


@pytest.fixture(scope="module")
def gc():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_every_step_is_time_boxed_and_the_whole_check_fits_8_minutes(gc, tmp_path):
    assert all(s.limit_s > 0 for s in gc.STEPS) and gc.TOTAL_S < 8 * 60
    assert gc.main(["--dry-run", "--out", str(tmp_path)]) == 0
    plan = json.loads((tmp_path / "gpu-check-plan.json").read_text())
    argv = {s["name"]: s["argv"] for s in plan["steps"]}
    assert list(argv) == ["env", "probes", "quickstart", "tiny_model", "bf16_tsp", "resume", "bench"]
    assert "iterations=2" in argv["quickstart"] and "cluster.local.workers_per_gpu=2" in argv["quickstart"]
    assert "--resume" in argv["resume"] and argv["resume"][argv["resume"].index("--out") + 1] == str(
        tmp_path / "bf16_tsp"
    )
    assert argv["bench"][-4:] == ["doctor", "--gpu-bench", "--out", str(tmp_path / "bench")]
    assert not (tmp_path / "gpu-check.json").exists()  # a dry run runs nothing


def test_without_cuda_the_cuda_steps_are_skipped_naming_why(gc, tmp_path):
    cuda_steps = [s for s in gc.STEPS if s.cuda]
    res = gc.run_steps(tmp_path, 100, (False, "no CUDA device here"), cuda_steps)
    assert res["steps"] == {s.name: {"status": "skipped", "why": "no CUDA device here"} for s in cuda_steps}
    table = (tmp_path / "gpu-check.md").read_text()
    assert table.count("| skipped |") == len(cuda_steps)
    assert json.loads((tmp_path / "gpu-check.json").read_text())["steps"] == res["steps"]


@pytest.mark.slow
def test_a_step_past_its_limit_is_ended_and_the_next_one_runs(gc, tmp_path):
    slow = gc.Step("slow", 1, False, "sleeps a minute")
    got = gc.run_one(slow, [sys.executable, "-c", "import time; time.sleep(60)"], 1.0, tmp_path)
    assert got["status"] == "timed out" and got["limit_s"] == 1.0
    failing = gc.run_one(slow, [sys.executable, "-c", "raise SystemExit('broken')"], 30, tmp_path)
    assert failing["status"] == "failed" and failing["rc"] == 1 and failing["tail"] == ["broken"]


def test_a_spent_budget_skips_what_is_left(gc, tmp_path):
    res = gc.run_steps(tmp_path, 0, (True, ""), [s for s in gc.STEPS if not s.cuda])
    assert {r["status"] for r in res["steps"].values()} == {"skipped"}
    assert all("budget" in r["why"] for r in res["steps"].values())
