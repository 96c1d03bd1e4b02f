"""``eval`` and ``reward`` tasks through the real queue (embedded Redis, Dask LocalCluster).

The distributed modes evaluate what the reference evaluates (same version, ODE sampler, fixed
seeds: same scores), and scoring on reward workers gives the reference's per-sample rewards
and final weights (staleness 0)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from digen.reference import run_reference
from digen.runtime.controller import run_distributed
from tests.runtime.test_equivalence import assert_bit_identical, checkpoint, max_diff, metrics
from tests.trainer.test_evaluation import EMA, EMA_LR, eval_config, eval_rows, last_checkpoint_scores

pytestmark = pytest.mark.slow


def timeline(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "timeline.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference_eval_run(tiny_sd3, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref-eval")
    run_reference(eval_config(tiny_sd3, tmp), tmp / "run")
    return tmp / "run"


def test_distributed_eval_equals_reference_eval(reference_eval_run, tiny_sd3, tmp_path, warm_cluster):
    cfg = eval_config(tiny_sd3, tmp_path, schedule={"mode": "disaggregated", "max_staleness": 0})
    run_distributed(cfg, tmp_path / "run", scheduler=warm_cluster(1, 1))
    ref, got = eval_rows(reference_eval_run), eval_rows(tmp_path / "run")
    assert [(r["iteration"], r["policy_version"]) for r in got] == [(1, 2), (2, 3)]
    for r, g in zip(ref, got, strict=True):
        assert g["scores"].keys() == r["scores"].keys()
        for k in r["scores"]:
            assert g["scores"][k] == pytest.approx(r["scores"][k], abs=1e-4), k
    # evaluating did not change training: the reference's rewards and weights, bit for bit
    assert_bit_identical(reference_eval_run, tmp_path / "run", cfg.iterations)
    evals = [e for e in timeline(tmp_path / "run") if e["kind"] == "eval"]
    assert evals and {e["role"] for e in evals} == {"rollout"}
    assert {(e["iteration"], e["version"]) for e in evals} == {(1, 2), (2, 3)}
    assert sorted(p.name for p in (tmp_path / "run" / "eval").glob("*.png")) == [
        "iter_0001.png",
        "iter_0002.png",
    ]


def test_distributed_ema_eval_equals_reference_ema_eval(tiny_sd3, tmp_path):
    """``train.ema.eval``: the rollout workers evaluate the EMA the trainers serve with the
    evaluated versions, as the reference evaluates its own; training is the reference's."""
    sections = {"train__ema": EMA, "train__lr": EMA_LR}
    run_reference(eval_config(tiny_sd3, tmp_path, **sections), tmp_path / "ref")
    cfg = eval_config(tiny_sd3, tmp_path, **sections, schedule={"mode": "disaggregated", "max_staleness": 0})
    run_distributed(cfg, tmp_path / "run")
    ref, got = eval_rows(tmp_path / "ref"), eval_rows(tmp_path / "run")
    assert [(r["iteration"], r["policy_version"]) for r in got] == [(1, 2), (2, 3)]
    for r, g in zip(ref, got, strict=True):
        for k in r["scores"]:
            assert g["scores"][k] == pytest.approx(r["scores"][k], abs=1e-6), k  # measured: equal
    assert_bit_identical(tmp_path / "ref", tmp_path / "run", cfg.iterations)
    by_ema, by_weights = last_checkpoint_scores(cfg, tmp_path / "run")
    assert got[-1]["scores"]["reward"] == pytest.approx(by_ema, abs=1e-6)
    assert max(abs(x - y) for x, y in zip(got[-1]["scores"]["reward"], by_weights, strict=True)) > 1e-4


def test_digen_mode_evaluates_in_the_bubbles_with_the_recorded_version(tiny_sd3, tmp_path, warm_cluster):
    cfg = eval_config(tiny_sd3, tmp_path, schedule={"mode": "digen"})
    cfg.eval.every = 1
    run_distributed(cfg, tmp_path / "run", scheduler=warm_cluster(1, 1))
    rows = eval_rows(tmp_path / "run")
    assert [(r["iteration"], r["policy_version"]) for r in rows] == [(0, 1), (1, 2), (2, 3)]
    events = timeline(tmp_path / "run")
    evals = [e for e in events if e["kind"] == "eval"]
    assert {(e["iteration"], e["version"]) for e in evals} == {(0, 1), (1, 2), (2, 3)}
    # the step of iteration k releases the generation of k + 2 (staleness 1) before the
    # evaluation of version k + 1, which goes only once no generation task is outstanding
    for e in evals:
        before = [g for g in events if g["kind"] == "gen" and g["iteration"] <= e["iteration"] + 2]
        assert all(g["end"] <= e["start"] for g in before), e


def test_reward_workers_give_the_reference_rewards_and_weights(reference_eval_run, tiny_sd3, tmp_path):
    cfg = eval_config(
        tiny_sd3,
        tmp_path,
        schedule={"mode": "disaggregated", "max_staleness": 0},
        cluster__local={"rollout_workers": 1, "trainer_workers": 1, "reward_workers": 1},
    )
    cfg.eval.every = 0
    run_distributed(cfg, tmp_path / "run")
    # the reward worker scores the decoded float32 tensor the inline path scores, read back
    # from safetensors; rewards have differed from the inline ones by 1e-7 (float32 round-off)
    got, ref = metrics(tmp_path / "run"), metrics(reference_eval_run)
    assert [m["rewards"] for m in got] == [pytest.approx(m["rewards"], abs=1e-6) for m in ref]
    assert max_diff(checkpoint(reference_eval_run), checkpoint(tmp_path / "run")) <= 1e-5
    events = timeline(tmp_path / "run")
    scored = [e for e in events if e["kind"] == "reward"]
    assert len(scored) == 3 * 2  # every group of every iteration, on the reward worker
    assert {(e["role"], e["worker"]) for e in scored} == {("reward", "reward-0")}
