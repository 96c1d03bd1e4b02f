"""Every model family trains: one iteration of `reference` and of `digen` mode on its tiny model."""

from __future__ import annotations

import json
import math

import pytest

from digen.reference import run_reference
from digen.runtime.controller import run_distributed

FAMILIES = ["sd3", "flux", "qwen-image", "wan", "hunyuan-video"]
VIDEO_FRAMES = {"wan": 5, "hunyuan-video": 5}


def rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("arch", FAMILIES)
def test_family_trains_in_reference_and_digen_mode(arch, tiny_models, tmp_path, warm_cluster):
    from digen.config import build_config
    from tests.conftest import small_config_data

    data = small_config_data(
        tiny_models(arch), iterations=1, rollout__num_steps=3, rollout__batch_size=4, rollout__group_size=2
    )
    if arch in VIDEO_FRAMES:
        data["model"]["num_frames"] = VIDEO_FRAMES[arch]
    if arch == "qwen-image":
        data["rollout"]["guidance_scale"] = 2.0  # true CFG, in sampling and re-scoring
    ref = tmp_path / "ref"
    run_reference(build_config(data), ref)
    r = rows(ref)[0]
    assert r["samples"] == 4 and r["trained_rows"] == 4  # floor(3 * 0.5) = 1 step per sample
    assert all(math.isfinite(x) for x in r["rewards"])
    assert r["ratio_max_dev"] == 0.0
    assert (ref / "samples/iter_0000.png").exists()

    data["schedule"] = {"mode": "digen", "max_staleness": 0}
    dist = tmp_path / "digen"
    run_distributed(build_config(data), dist, scheduler=warm_cluster(1, 1))  # one worker pair, five families
    d = rows(dist)[0]
    assert d["rewards"] == pytest.approx(r["rewards"], abs=1e-6)
    assert d["loss"] == pytest.approx(r["loss"], abs=1e-6)
