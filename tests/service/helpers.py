"""Helpers of the service tests: the tiny test config and its test overrides, a run's learning
rows. The subprocesses and the waiting are :mod:`tests.processes`'."""

from __future__ import annotations

import json
from pathlib import Path

CONFIG = Path(__file__).with_name("tiny.yaml")  # the tiny workload; tests --set its model path
ITERATIONS = 8
TIMING = {"wall_s", "samples_per_s", "busy_s", "worker_s", "bubble_ratio"}
# the prompt-embedding cache's counters follow the worker processes, not the learning: a
# resumed job's new workers start with an empty cache (digen.prompt_cache)
PROCESS_COUNTERS = {"embed_cache_hits", "embed_cache_misses", "embed_cache_hit_rate"}


def quick_sets(model_dir: Path, iterations: int = ITERATIONS, *extra: str) -> list[str]:
    """``--set`` overrides of CONFIG for a test run."""
    sets = [f"model.path={model_dir}", f"iterations={iterations}", *extra]
    return [a for s in sets for a in ("--set", s)]


def learning_rows(run_dir: Path) -> list[dict]:
    """``metrics.jsonl`` without the timing columns and the per-process cache counters."""
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line]
    return [{k: v for k, v in r.items() if k not in TIMING | PROCESS_COUNTERS} for r in rows]
