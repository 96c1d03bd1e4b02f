"""Synthetic run data for the chart, grid and report tests (no model, no cluster)."""

from __future__ import annotations

import json
from pathlib import Path

ROLL = {"worker": "rollout-0", "gpu_type": "h100", "role": "rollout"}
TRAIN = {"worker": "trainer-0", "gpu_type": "l40s", "role": "trainer"}
CTL = {"worker": "controller", "gpu_type": "cpu", "role": "controller"}


def timeline_rows(iterations: int = 3, groups: int = 2) -> list[dict]:
    """A digen-like timeline: the rollout worker generates iteration k with version k-1 (stale
    for k >= 1), the trainer trains each group, the controller steps. Starts at t=1000 s."""
    rows: list[dict] = []
    t = 1000.0
    for k in range(iterations):
        version = max(0, k - 1)
        tt = t
        for _ in range(groups):
            for kind, d in (("gen", 0.3), ("decode", 0.05), ("reward", 0.01)):
                rows.append(
                    {**ROLL, "kind": kind, "iteration": k, "version": version, "start": t, "end": t + d}
                )
                t += d
            tt = max(tt, t)
            rows.append(
                {**TRAIN, "kind": "train", "iteration": k, "version": k, "start": tt, "end": tt + 0.2}
            )
            tt += 0.2
        rows.append({**TRAIN, "kind": "sync", "iteration": k, "version": k, "start": tt, "end": tt + 0.01})
        rows.append({**CTL, "kind": "optim", "iteration": k, "version": k, "start": tt, "end": tt + 0.02})
        rows.append(
            {**CTL, "kind": "sync", "iteration": k, "version": k + 1, "start": tt + 0.02, "end": tt + 0.03}
        )
        t = max(t, tt + 0.03)
    return rows


def metrics_rows(iterations: int = 5) -> list[dict]:
    return [
        {
            "iteration": k,
            "policy_version": k + 1,
            "samples": 8,
            "reward_mean": 0.4 + 0.01 * k,
            "reward_std": 0.05,
            "loss": 0.001 * k,
            "approx_kl": 1e-6 * k,
            "clipfrac": 0.01 * k,
            "kl": 0.0,
            "grad_norm": 0.5,
            "wall_s": 1.0,
            "samples_per_s": 8.0,
            "busy_s": 1.5,
            "worker_s": 2.0,
            "bubble_ratio": 0.25,
            "max_staleness": 1,
            "rewards": [0.4 + 0.01 * k] * 8,
        }
        for k in range(iterations)
    ]


def write_run(root: Path, *, summary: bool = True, grid_png: bytes | None = None) -> Path:
    """A run directory with config.yaml, metrics, timeline, summary and one sample grid."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.yaml").write_text("seed: 0\niterations: 5\nschedule:\n  mode: digen\n")
    (root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics_rows()))
    (root / "timeline.jsonl").write_text("".join(json.dumps(r) + "\n" for r in timeline_rows()))
    if summary:
        (root / "summary.json").write_text(
            json.dumps(
                {"mode": "digen", "iterations": 5, "samples": 40, "samples_per_s": 8.0, "reward_last": 0.4321}
            )
        )
    if grid_png is not None:
        (root / "samples").mkdir(exist_ok=True)
        (root / "samples" / "iter_0000.png").write_bytes(grid_png)
    return root
