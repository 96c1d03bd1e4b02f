"""Shared pieces of the reliability suite: fault-injection switch, reference runs, run readers."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from digen.config import Config, build_config
from tests.conftest import faults_on, small_config_data


@pytest.fixture(scope="module", autouse=True)
def _faults_on() -> Iterator[None]:
    """Worker processes started in this module run the fault hooks (they inherit the env)."""
    with faults_on():
        yield


def fault_config(model_dir: Path, **sections) -> Config:
    """The suite's job: 3 iterations of 2 groups x 4 samples, no grids or plots; the trainers
    sum gradients in the reference's order (``train.reduce: exact``), so a run that survived
    its faults is compared with the reference bit for bit."""
    base = {"iterations": 3, "output": {"sample_grid_every": 0, "plots": False}}
    data = small_config_data(model_dir, **sections)
    data["train"].setdefault("reduce", "exact")
    for key, value in base.items():
        if key not in {k.split("__")[0] for k in sections}:
            data[key] = value
    return build_config(data)


@contextmanager
def one_thread() -> Iterator[None]:
    """Torch on one thread, as in the workers (threads_per_worker 1): the same float sums."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@pytest.fixture(scope="session")
def reference(tiny_sd3: Path, tmp_path_factory) -> Path:
    """The fault-free oracle: the reference trainer on :func:`fault_config`."""
    from digen.reference import run_reference

    out = tmp_path_factory.mktemp("reference") / "run"
    with one_thread():
        run_reference(fault_config(tiny_sd3), out)
    return out


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def timeline(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "timeline.jsonl").read_text().splitlines()]


def weights(run: Path, iteration: int | None = None) -> dict[str, torch.Tensor]:
    folders = sorted((run / "checkpoints").glob("iter_*"))
    folder = folders[-1] if iteration is None else run / "checkpoints" / f"iter_{iteration:04d}"
    return load_file(str(folder / "weights.safetensors"))


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def assert_exactly_once(run: Path, groups: int = 2, samples: int = 8, rows: int = 16) -> None:
    """Every iteration trained the configured samples, and every task's result was counted
    once: each collected result adds its own ``gen``/``train`` timeline events."""
    rows_ = metrics(run)
    assert [m["samples"] for m in rows_] == [samples] * len(rows_)
    assert [m["trained_rows"] for m in rows_] == [rows] * len(rows_)
    counts = Counter((e["iteration"], e["kind"]) for e in timeline(run) if e["kind"] in ("gen", "train"))
    for m in rows_:
        assert counts[(m["iteration"], "gen")] == groups, counts
        assert counts[(m["iteration"], "train")] == groups, counts


def assert_equals_reference(run: Path, ref: Path) -> None:
    """Same per-sample rewards every iteration, same final weights (max_staleness 0)."""
    got, want = metrics(run), metrics(ref)
    assert [m["iteration"] for m in got] == [m["iteration"] for m in want]
    for g, w in zip(got, want, strict=True):
        assert g["rewards"] == pytest.approx(w["rewards"], abs=1e-6, nan_ok=True)
    assert max_diff(weights(run), weights(ref)) <= 1e-5


def run_job(
    cfg: Config,
    out: Path,
    job_id: str,
    *faults,
    redis_url: str | None = None,
    on_start: Callable | None = None,
    progress: Callable | None = None,
) -> list[dict]:
    """Run ``cfg`` distributed with ``faults`` armed; returns the faults that fired."""
    from digen.controlplane.redis_conn import connect
    from digen.runtime.controller import run_distributed
    from digen.testing.faults import arm, clear, fired

    r = connect(redis_url)
    clear(r, job_id)
    arm(r, job_id, *faults)
    try:
        run_distributed(cfg, out, job_id=job_id, redis_url=redis_url, on_start=on_start, progress=progress)
        return fired(r, job_id)
    finally:
        clear(r, job_id)
        r.close()
