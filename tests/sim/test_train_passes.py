"""The simulator's training passes follow the runtime's rule (:func:`digen.training.forward_chunks`):
with TSP a train task's rows go in passes of at most ``rows_per_forward``, without TSP one
pass per trained step; each pass computes at its own tokens' efficiency and pays the FSDP
gathers. Numbers below are worked by hand from the model's figures."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml

from digen.errors import ConfigError
from digen.sim.calibrate import costmodel_from_run
from digen.sim.catalog import load_sim_config
from digen.sim.costmodel import (
    ROWS_PER_FORWARD,
    EfficiencyCurve,
    ModelSpec,
    PaperInputs,
    Workload,
    paper_costmodel,
)
from digen.sim.costmodel import Testbed as Bed
from digen.training import build_rows, forward_chunks
from tests.sim.test_batched_tasks import (  # full fine-tune (FSDP): a row is 2 TFLOP x 3 / 300 TFLOPS = 0.02 s, a gather 0.48 s
    FULL,
    GPU,
)
from tests.sim.test_calibrate import source_model, write_run

CATALOG = Path(__file__).resolve().parents[2] / "configs" / "sim" / "catalog.yaml"

# a pass gathers the 24 GB bf16 weights for its forward and its backward and reduce-scatters
# their 48 GB float32 gradient (12 G parameters x 4 B), at 50 GB/s
ROW_S, GATHERS, LAYERS = 0.02, (2 * 24 + 48) / 50, 40
CURVE = EfficiencyCurve(half_tokens=256, ref_tokens=4096, cap=1.05)
# K = 10 x 0.4 = 4 trained steps a sample
WL = Workload("w", FULL, steps=10, timestep_fraction=0.4, prompts=8, group_size=4, samples_per_task=1)


def worker(
    rows_per_forward: int = 64,
    model: ModelSpec = FULL,
    curve: EfficiencyCurve | None = None,
    samples: int = 1,
):
    wl = replace(WL, model=model, rows_per_forward=rows_per_forward, samples_per_task=samples)
    bed = Bed("t", 25, ((GPU, 1),))
    paper = PaperInputs(wl, bed, curve=curve) if curve else None
    return paper_costmodel(wl, bed, paper=paper).workers[0].cost


def fsdp_pass(compute_s: float) -> float:
    """One FSDP pass: the longer of compute and gathers, plus one layer's exposed gather."""
    return max(compute_s, GATHERS) + GATHERS / LAYERS


def runtime_passes(groups: int, samples: int, k: int, tsp: bool, limit: int) -> list[int]:
    """Rows of each forward the runtime makes for a task of these rows (prefix: steps 0..K-1)."""
    b, t = groups * samples, 10
    rows = build_rows(
        torch.zeros(b, t + 1, 1),
        torch.zeros(b, t),
        torch.linspace(1, 0, t + 1),
        torch.zeros(b),
        [list(range(k))] * b,
    )
    return [len(idx) for idx in forward_chunks(rows, tsp, limit)]


@pytest.mark.parametrize("tsp", [True, False])
@pytest.mark.parametrize(
    ("groups", "samples", "limit"),
    [(1, 1, 64), (5, 1, 8), (40, 1, 64), (3, 1, 1), (16, 1, 5), (3, 2, 7), (9, 4, 64)],
)
def test_the_passes_are_the_runtimes_forwards(groups, samples, limit, tsp):
    c = worker(limit, samples=samples)
    assert c.passes.sizes(groups, tsp) == runtime_passes(groups, samples, 4, tsp, limit)


def test_a_batched_task_over_rows_per_forward_makes_ceil_passes_each_gathering():
    c = worker(8)
    # 5 micro-batches x 1 sample x K=4 = 20 rows: ceil(20 / 8) = 3 passes of 8, 8, 4 rows
    assert c.passes.sizes(5, True) == [8, 8, 4] == runtime_passes(5, 1, 4, True, 8)
    # each pass's compute (at most 8 x 0.02 s) hides under its 1.92 s of collectives: 3 x the gathers
    assert c.train_task_s(5, True) == pytest.approx(3 * fsdp_pass(0.0))
    # uncapped, the same rows were one pass: two passes' gathers fewer
    assert worker(10**6).train_task_s(5, True) == pytest.approx(fsdp_pass(0.0))
    # without TSP the runtime makes one pass per trained step (5 rows: under rows_per_forward)
    assert c.passes.sizes(5, False) == [5, 5, 5, 5]
    # a step of more rows than rows_per_forward is cut too: 12 rows a step, 8 + 4
    assert c.passes.sizes(12, False) == [8, 4] * 4 == runtime_passes(12, 1, 4, False, 8)
    assert c.train_task_s(5, False) == pytest.approx(4 * fsdp_pass(0.0))


@pytest.mark.parametrize("tsp", [True, False])
def test_one_micro_batch_costs_what_the_unbatched_task_does(tsp):
    for c in (worker(), worker(curve=CURVE), worker(model=replace(FULL, adapter_gb=0.2), curve=CURVE)):
        one = c.train_tsp_s if tsp else c.train_s
        assert c.train_task_s(1, tsp) == one
        # the pass rule gives the same seconds as the task's closed form (K rows fit one pass)
        assert c.passes.task_s(1, tsp, c.train_gather_s, c.layers) == pytest.approx(one, rel=1e-12)


def test_a_single_task_over_rows_per_forward_is_cut_too():
    c, uncapped = worker(3), worker()
    # K=4 rows, 3 a pass: 2 passes (3 + 1 rows), each gathering: one more pass's gathers
    assert c.train_tsp_s == pytest.approx(2 * fsdp_pass(0.0))
    assert uncapped.train_tsp_s == pytest.approx(fsdp_pass(0.0))
    assert c.train_s == uncapped.train_s  # without TSP: K passes either way


def test_a_large_rows_per_forward_reproduces_the_uncapped_model():
    # flat curve: the uncapped model's one pass of all rows, compute scaled linearly
    for groups in (1, 8, 32):
        uncapped = fsdp_pass(groups * 4 * ROW_S)
        assert worker(10**6).train_task_s(groups, True) == pytest.approx(uncapped, rel=1e-12)
    # the default 64 cuts 32 x 4 = 128 rows into two passes of 64 (1.28 s of compute each)
    assert worker().train_task_s(32, True) == pytest.approx(2 * fsdp_pass(64 * ROW_S))
    assert 2 * fsdp_pass(64 * ROW_S) > fsdp_pass(128 * ROW_S)


def relative_efficiency(tokens: float) -> float:
    """:data:`CURVE` by hand: ``n / (n + 256)`` over its value at 4,096 tokens, at most 1.05."""
    return min(1.05, (tokens / (tokens + 256)) / (4096 / (4096 + 256)))


def test_each_pass_computes_at_its_own_tokens_efficiency():
    lora = replace(FULL, adapter_gb=0.2)  # no FSDP: seconds are compute alone
    c = worker(model=lora, curve=CURVE)
    # one micro-batch: K=4 rows, 4,096 tokens, the reference efficiency
    assert c.train_task_s(1, True) == pytest.approx(4 * ROW_S)
    # 4 micro-batches: 16 rows, 16,384 tokens, a fuller pass than 4 separate ones
    eff = relative_efficiency(16 * 1024)
    assert 1.04 < eff < 1.05
    assert c.train_task_s(4, True) == pytest.approx(16 * ROW_S / eff)
    # without TSP: 4 passes of one row each (1,024 tokens), batched 4 passes of 4 rows
    assert c.train_task_s(1, False) == pytest.approx(4 * ROW_S / relative_efficiency(1024))
    assert c.train_task_s(4, False) == pytest.approx(4 * 4 * ROW_S / relative_efficiency(4096))
    # rows_per_forward 8: two passes of 8 rows at 8,192 tokens' efficiency
    capped = worker(8, model=lora, curve=CURVE)
    assert capped.train_task_s(4, True) == pytest.approx(2 * 8 * ROW_S / relative_efficiency(8 * 1024))


def test_rows_per_forward_must_be_positive(tmp_path):
    with pytest.raises(ConfigError, match="rows_per_forward"):
        replace(WL, rows_per_forward=0)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        yaml.safe_dump({"catalog": "catalog.yaml", "workload": "w", "testbed": "t", "rows_per_forward": 0})
    )
    with pytest.raises(ConfigError, match="rows_per_forward"):
        load_sim_config(cfg)


def test_a_run_config_sets_rows_per_forward(tmp_path):
    run = {
        "catalog": str(CATALOG),
        "workload": "flow-grpo-qwen-image",
        "testbed": "B",
        "samples_per_task": 8,
        "rows_per_forward": 32,
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))
    setup = load_sim_config(tmp_path / "run.yaml")
    assert setup.workload.rows_per_forward == setup.cost.rows_per_forward == 32
    k = setup.workload.trained_timesteps  # 12: 8 x 12 = 96 rows, 3 passes of 32
    c = setup.cost.workers[0].cost
    assert c.passes.sizes(1, True) == [32] * math.ceil(8 * k / 32)


def test_a_measured_model_takes_rows_per_forward_from_its_run(tmp_path):
    write_run(tmp_path / "default", source_model())
    assert costmodel_from_run(tmp_path / "default").rows_per_forward == ROWS_PER_FORWARD == 64
    write_run(tmp_path / "run", source_model())
    cfg = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    (tmp_path / "run" / "config.yaml").write_text(yaml.safe_dump({**cfg, "train": {"rows_per_forward": 16}}))
    assert costmodel_from_run(tmp_path / "run").rows_per_forward == 16
