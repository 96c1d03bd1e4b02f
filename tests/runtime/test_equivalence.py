"""The distributed modes compute what the reference computes (DESIGN.md: correctness first).

Real embedded Redis, real Dask local cluster, real worker processes. With max_staleness 0 the
per-sample rewards and the final weights equal the reference run's (tolerance 1e-5 on weights;
the samples are generated in the same batches, so rewards match to float precision)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from digen.runtime.controller import run_distributed
from digen.trainer import run_reference

pytestmark = pytest.mark.slow


def rewards(run: Path) -> list[list[float]]:
    return [json.loads(line)["rewards"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def weights(run: Path) -> dict[str, torch.Tensor]:
    last = sorted((run / "checkpoints").glob("iter_*"))[-1]
    return load_file(str(last / "weights.safetensors"))


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module")
def reference_run(tiny_sd3, tmp_path_factory):
    from digen.config import build_config
    from tests.conftest import small_config_data

    out = tmp_path_factory.mktemp("ref") / "run"
    run_reference(build_config(small_config_data(tiny_sd3, iterations=3)), out)
    return out


@pytest.mark.parametrize(
    "mode,gap,tsp,rollout,trainers",
    [
        ("colocated", False, False, 1, 1),
        ("disaggregated", False, False, 1, 1),
        ("disaggregated", True, True, 1, 2),
        ("digen", True, True, 1, 2),
    ],
)
def test_distributed_equals_reference(
    reference_run, small_config, tmp_path, mode, gap, tsp, rollout, trainers
):
    cfg = small_config(
        iterations=3,
        schedule__mode=mode,
        schedule__gap=gap,
        schedule__tsp=tsp,
        schedule__max_staleness=0,
        schedule__tag=mode == "digen",
        cluster__local={"rollout_workers": rollout, "trainer_workers": trainers},
    )
    out = tmp_path / mode
    run_distributed(cfg, out)
    ref, got = rewards(reference_run), rewards(out)
    assert len(got) == 3
    for r_it, g_it in zip(ref, got, strict=True):
        assert g_it == pytest.approx(r_it, abs=1e-6)
    assert max_diff(weights(reference_run), weights(out)) <= 1e-5
    timeline = [json.loads(line) for line in (out / "timeline.jsonl").read_text().splitlines()]
    workers = {e["worker"] for e in timeline if e["worker"] != "controller"}
    assert len(workers) == rollout + trainers
    # staleness 0: every task ran with the iteration's own version
    assert all(e["version"] == e["iteration"] for e in timeline if e["kind"] in ("gen", "train"))
