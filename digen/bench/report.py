"""The bench's outputs: ``bench.json``, ``tsp.json`` and ``bench.md``, the Markdown tables of
the modes, their start-up, held-out evaluation's cost and the TSP micro-benchmark."""

from __future__ import annotations

import os
from pathlib import Path

from digen.bench.runs import BenchResult


def _of_bound(r: dict) -> str:
    """The "of bound" cell: flagged "(invalid)" when the bound does not hold
    (:func:`digen.bench.summary.bound_validity`), so no fraction above 100% stands unflagged;
    "(CPU time)" when the bound came from the tasks' CPU seconds
    (:func:`digen.bench.summary.choose_bound`)."""
    cell = _fmt(r["fraction_of_bound"], ".0%")
    if not r.get("bound_valid", True):
        return f"{cell} (invalid)"
    return f"{cell} (CPU time)" if r.get("bound_source") == "cpu" else cell


def _fmt(x: float | None, spec: str, suffix: str = "") -> str:
    return "n/a" if x is None else format(x, spec) + suffix


def markdown_table(
    rows: list[dict],
    tsp: list[dict],
    *,
    command: str | None = None,
    rounds: int | None = None,
    warmup: int | None = None,
    batching: list[dict] | None = None,
) -> str:
    """The bench result as Markdown: one table of modes, one of the TSP micro-benchmark, one
    of the generation-batching micro-benchmark."""
    lines = []
    if command:
        lines += [f"`{command}`", ""]
    if rounds is not None:
        lines += [
            f"{rounds} interleaved round(s), medians over iterations >= {warmup}; "
            f"{os.cpu_count()} CPU core(s).",
            "",
        ]
    lines += [
        "| mode | workers | s/iteration | samples/s | bubble | bubble by role | vs colocated | vs disaggregated "
        "| bound samples/s | of bound | peak RSS MiB (per worker) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        roles = ", ".join(f"{k} {v:.2f}" for k, v in r["bubble_ratio_by_role"].items())
        rss = (
            ", ".join(
                f"{w['worker']} {w['peak_rss_mb']:.0f}"
                for w in r["per_worker"]
                if w["peak_rss_mb"] is not None
            )
            or "n/a"
        )
        lines.append(
            f"| {r['mode']} | {r['workers']} | {r['s_per_iteration']:.3f} | {r['samples_per_s']:.2f} "
            f"| {r['bubble_ratio']:.2f} | {roles} | {_fmt(r['speedup_vs_colocated'], '.2f', 'x')} "
            f"| {_fmt(r['speedup_vs_disaggregated'], '.2f', 'x')} | {r['bound_samples_per_s']:.2f} "
            f"| {_of_bound(r)} | {rss} |"
        )
    flagged = [r for r in rows if r.get("bound_warning")]
    if flagged:
        lines += [""] + [f"Bound invalid for {r['mode']}: {r['bound_warning']}." for r in flagged]
    cpu = [r for r in rows if r.get("bound_source") == "cpu" and not r.get("bound_warning")]
    if cpu:
        lines += [""] + [
            f"Bound for {r['mode']} from the tasks' CPU seconds ({r['busy_workers']:.1f} workers busy at once "
            f"on {r['cores']} core(s); from their wall-clock durations it would be "
            f"{r['bound_samples_per_s_wall']:.2f} samples/s)."
            for r in cpu
        ]
    lines += startup_table(rows)
    lines += eval_table(rows)
    if tsp:
        lines += [
            "",
            "TSP micro-benchmark (one train task: a group x K timesteps; batched = one forward/"
            "backward, sequential = K):",
            "",
            "| K | rows | batched ms/row | sequential ms/row | speedup |",
            "|---|---|---|---|---|",
        ]
        for t in tsp:
            lines.append(
                f"| {t['K']} | {t['rows']} | {t['batched_ms_per_row']:.2f} | "
                f"{t['sequential_ms_per_row']:.2f} | {_fmt(t['speedup'], '.2f', 'x')} |"
            )
    lines += batching_table(batching or [])
    return "\n".join(lines) + "\n"


def batching_table(batching: list[dict]) -> list[str]:
    """Markdown lines of the generation-batching micro-benchmark
    (:func:`digen.bench.batching.batching_microbench`); none without rows."""
    if not batching:
        return []
    reset = all(b.get("rss_reset", True) for b in batching)
    lines = [
        "",
        "Generation batching (rollout.max_batch groups as one forward per denoising step, in the bench "
        "process; peak RSS of one batch"
        + ("" if reset else ", the process's peak so far: its high-water mark could not be reset")
        + "):",
        "",
        "| max_batch | samples | ms/sample | samples/s | vs first | peak RSS MiB | RSS over first MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for b in batching:
        lines.append(
            f"| {b['max_batch']} | {b['samples']} | {b['ms_per_sample']:.2f} | {_fmt(b['samples_per_s'], '.2f')} "
            f"| {_fmt(b['speedup_vs_first'], '.2f', 'x')} | {_fmt(b['peak_rss_mb'], '.0f')} "
            f"| {_fmt(b['rss_over_first_mb'], '+.0f')} |"
        )
    return lines


def startup_table(rows: list[dict]) -> list[str]:
    """Markdown lines of the modes' start-up (:func:`startup_summary`); none without profiles."""
    if not any(r.get("startup", {}).get("first_iteration_s") is not None for r in rows):
        return []
    lines = [
        "",
        "Start-up (seconds from the run's start in the bench process; process-tree peak memory):",
        "",
        "| mode | first task s | first iteration s | vs reference s | tree RSS MiB | tree PSS MiB "
        "| PSS vs reference | slowest phases s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        st = r["startup"]
        slow = sorted(st["phase_s"].items(), key=lambda kv: -kv[1])[:3]
        lines.append(
            f"| {r['mode']} | {_fmt(st['first_task_s'], '.2f')} | {_fmt(st['first_iteration_s'], '.2f')} "
            f"| {_fmt(st['first_iteration_vs_reference_s'], '+.2f')} | {_fmt(st['peak_tree_rss_mb'], '.0f')} "
            f"| {_fmt(st['peak_tree_pss_mb'], '.0f')} | {_fmt(st['tree_pss_vs_reference'], '.2f', 'x')} "
            f"| {', '.join(f'{k} {v:.2f}' for k, v in slow) or 'n/a'} |"
        )
    return lines


def eval_table(rows: list[dict]) -> list[str]:
    """The report's held-out evaluation section: eval's cost from the timeline, per mode,
    and the wall ratio of each ``X+eval`` mode to its ``X-eval`` twin measured beside it."""
    evaluated = [r for r in rows if r.get("evaluations")]
    if not evaluated:
        return []
    by_mode = {r["mode"]: r for r in rows}
    lines = [
        "",
        "Held-out evaluation (per run; waits: released gen/train tasks held up while their worker ran an "
        "eval task, from the timeline's release and lease times):",
        "",
        "| mode | evaluations | eval worker-s | in bubbles s | outside s | task wait caused s "
        "| longest wait / longest eval task s | overtakes | s/iteration | vs -eval |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in evaluated:
        twin = by_mode.get(r["mode"].replace("+eval", "-eval"))
        ratio = r["s_per_iteration"] / twin["s_per_iteration"] if twin and twin["s_per_iteration"] else None
        lines.append(
            f"| {r['mode']} | {r['evaluations']:g} | {r['eval_worker_s']:.2f} "
            f"| {r.get('eval_in_bubbles_s', 0.0):.2f} | {r.get('eval_outside_bubbles_s', 0.0):.2f} "
            f"| {r.get('eval_wait_s', 0.0):.2f} "
            f"| {r.get('eval_max_wait_s', 0.0):.2f} / {r.get('eval_max_task_s', 0.0):.2f} "
            f"| {r.get('eval_overtakes', 0.0):g} | {r['s_per_iteration']:.3f} | {_fmt(ratio, '.2f', 'x')} |"
        )
    return lines


def write_outputs(
    result: BenchResult,
    out: Path,
    *,
    command: str | None = None,
    rounds: int | None = None,
    warmup: int | None = None,
) -> dict[str, Path]:
    """``bench.json`` (one object per mode), ``tsp.json``, ``batching.json`` (when the
    generation-batching micro-benchmark ran) and ``bench.md`` in ``out``."""
    import json

    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "bench.json", "tsp": out / "tsp.json", "markdown": out / "bench.md"}
    paths["json"].write_text(json.dumps(result.rows, indent=1))
    paths["tsp"].write_text(json.dumps(result.tsp, indent=1))
    if result.batching:
        paths["batching"] = out / "batching.json"
        paths["batching"].write_text(json.dumps(result.batching, indent=1))
    paths["markdown"].write_text(
        markdown_table(
            result.rows, result.tsp, command=command, rounds=rounds, warmup=warmup, batching=result.batching
        )
    )
    return paths
