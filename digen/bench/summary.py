"""bench.json's object per mode (:func:`summarize`): throughput, bubbles, the zero-bubble
bound, per-worker rates and memory, start-up and held-out evaluation's cost over its rounds,
and the ratios between modes (:func:`add_speedups`, :func:`add_startup_ratios`).

The bound (:func:`choose_bound`) is the LP of :mod:`digen.sim.bounds` over each worker's
generation and training rates. Measured in wall-clock seconds, a task's duration is the
worker's speed only when it had a core to itself; when more workers are busy at once than
the process may use cores (``busy_workers`` > ``cores``), or the throughput beats the wall
bound (something else took the cores), the bound is taken from the tasks' CPU seconds
instead (each timed row's ``cpu_s``: :func:`time.thread_time` of the thread that ran it),
which waiting for a core does not inflate. A bound that still does not hold is flagged
invalid: no "of bound" above 100% stands unflagged.
"""

from __future__ import annotations

import os
from typing import Any

from digen.bench.stats import RatePool, RunRecord, WorkerStats, bubble_by_role, median, worker_stats
from digen.errors import ConfigError
from digen.rundir import _read_jsonl
from digen.sim.bounds import lp_bound

SUMMED = (
    "gen_groups",
    "gen_s",
    "train_groups",
    "train_s",
    "gen_cpu_s",
    "train_cpu_s",
    "cpu_missing",
    "busy_s",
    "window_s",
    "redis_round_trips",
    "cycles",
)
"""The :class:`WorkerStats` fields that add up over a mode's rounds."""


def summarize(
    mode: str,
    records: list[RunRecord],
    pool: RatePool,
    group_size: int,
    warmup: int,
    cores: int | None = None,
) -> dict:
    """bench.json's object for one mode (all its rounds); ``cores``: the CPU cores the workers
    had (default :func:`usable_cores`)."""
    rows = [m for rec in records for m in rec.metrics if int(m["iteration"]) >= warmup]
    if not rows:
        raise ConfigError(
            f"mode {mode}: no iteration >= --warmup {warmup}; raise iterations or lower --warmup"
        )
    per_round = [
        median([float(m["samples_per_s"]) for m in rec.metrics if int(m["iteration"]) >= warmup])
        for rec in records
    ]
    busy, worker_s = (
        sum(float(m.get("busy_s", 0.0)) for m in rows),
        sum(float(m.get("worker_s", 0.0)) for m in rows),
    )
    merged, bubbles, role_bubbles = pool_rounds(records, warmup)
    tsp = records[0].tsp
    workers, gens, trains = worker_rows(merged, pool, group_size, tsp)
    wall = lp_bound(gens, trains)
    cpu_rates = cpu_worker_rates(merged, pool, group_size, tsp)
    cpu = lp_bound(*cpu_rates) if cpu_rates is not None else None
    sps = median([float(m["samples_per_s"]) for m in rows])
    bound = choose_bound(sps, wall.x, cpu.x if cpu is not None else None, merged, cores or usable_cores())
    solution = cpu if bound["bound_source"] == "cpu" and cpu is not None else wall
    for wd, f in zip(workers, solution.fractions, strict=True):
        wd["bound_gen_fraction"] = round(f, 4)
    trips, cycles = sum(m.redis_round_trips for m in merged.values()), sum(m.cycles for m in merged.values())
    window_s = sum(m.window_s for m in merged.values())
    ctl_peak = [rec.peak_rss_mb["controller"] for rec in records if "controller" in rec.peak_rss_mb]
    return {
        "mode": mode,
        "workers": len(workers),
        "iterations_measured": len(rows),
        "rounds": len(records),
        "s_per_iteration": median([float(m["wall_s"]) for m in rows]),
        "samples_per_s": sps,
        "samples_per_s_rounds": per_round,
        "bubble_ratio": median(bubbles),
        "bubble_ratio_by_role": {r: median(bs) for r, bs in role_bubbles.items()},
        "bubble_ratio_metrics": max(0.0, 1 - busy / worker_s) if worker_s > 0 else 0.0,
        "speedup_vs_colocated": None,
        "speedup_vs_disaggregated": None,
        **bound,
        "controller_peak_rss_mb": round(max(ctl_peak), 1) if ctl_peak else None,
        "startup": startup_summary([rec.startup for rec in records]),
        **eval_cost(records),
        "worker_redis_round_trips_per_s": round(trips / window_s, 2) if trips and window_s > 0 else None,
        "worker_redis_round_trips_per_cycle": round(trips / cycles, 3) if cycles else None,
        "per_worker": workers,
        "run_dirs": [str(rec.run_dir) for rec in records],
    }


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one, else
    the machine's count): the workers the bench starts inherit it."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def busy_workers(merged: dict[str, WorkerStats]) -> float:
    """The mean number of workers running a task at once: busy seconds over the window."""
    windows = [m.window_s for m in merged.values() if m.window_s > 0]
    span = max(windows) if windows else 0.0
    return sum(m.busy_s for m in merged.values()) / span if span > 0 else 0.0


def choose_bound(
    sps: float, wall: float, cpu: float | None, merged: dict[str, WorkerStats], cores: int
) -> dict:
    """The bound bench.json reports for throughput ``sps``: ``wall`` (from task durations)
    where the workers had their cores, else ``cpu`` (from the tasks' CPU seconds; None where
    some task recorded none) when the machine was oversubscribed (more workers busy at once
    than ``cores``) or ``sps`` beats the wall bound; then :func:`bound_validity` of the one
    chosen. Returns ``bound_samples_per_s``, ``bound_source`` (``wall`` or ``cpu``),
    ``bound_samples_per_s_wall`` and ``_cpu``, ``fraction_of_bound`` and the validity keys."""
    oversubscribed = busy_workers(merged) > cores
    beaten = wall > 0 and sps > wall * (1 + 1e-9)
    use_cpu = cpu is not None and cpu > 0 and (oversubscribed or beaten)
    bound = cpu if use_cpu and cpu is not None else wall
    source = "cpu" if use_cpu else "wall"
    return {
        "bound_samples_per_s": bound,
        "bound_source": source,
        "bound_samples_per_s_wall": wall,
        "bound_samples_per_s_cpu": cpu,
        "fraction_of_bound": sps / bound if bound > 0 else None,
        **bound_validity(sps, bound, merged, cores, source=source),
    }


def bound_validity(
    sps: float, bound: float, merged: dict[str, WorkerStats], cores: int, *, source: str = "wall"
) -> dict:
    """Whether the bound holds. ``source`` ``wall``: built from task durations, which only
    measure a worker's speed when the workers did not share cores; ``busy_workers`` is the
    mean number of workers running a task at once, and above ``cores`` every task ran slower
    than alone, the rates are low and the bound with them: flagged invalid (no task recorded
    its CPU seconds, else :func:`choose_bound` took the ``cpu`` bound). ``cpu``: built from
    CPU seconds, which sharing cores does not inflate. A fraction above 1 is flagged
    whatever the source: the last resort.

    Returns ``bound_valid``, ``bound_warning`` (None when valid), ``busy_workers``, ``cores``."""
    concurrency = busy_workers(merged)
    warnings = []
    if concurrency > cores and source == "wall":
        warnings.append(
            f"oversubscribed: {concurrency:.1f} workers busy at once on {cores} CPU core(s), so task "
            f"durations (and the bound built from them) include waiting for a core, and the tasks "
            f"recorded no CPU time to build it from instead"
        )
    if bound > 0 and sps > bound * (1 + 1e-9):
        what = "CPU-time bound" if source == "cpu" else "bound"
        warnings.append(
            f"throughput {sps:.3g} samples/s is above the {what} {bound:.3g}: the bound does not hold"
        )
    return {
        "bound_valid": not warnings,
        "bound_warning": "; ".join(warnings) or None,
        "busy_workers": round(concurrency, 2),
        "cores": cores,
    }


def pool_rounds(
    records: list[RunRecord], warmup: int
) -> tuple[dict[str, WorkerStats], list[float], dict[str, list[float]]]:
    """A mode's rounds together: each worker's stats summed over the rounds (the same worker
    names every round; peaks are maxima, the bench's own RSS samples included), the bubble
    ratio of each round and each role's per round."""
    merged: dict[str, WorkerStats] = {}
    role_bubbles: dict[str, list[float]] = {}
    bubbles: list[float] = []
    for rec in records:
        stats = worker_stats(rec.timeline, warmup)
        for role, b in bubble_by_role(stats).items():
            role_bubbles.setdefault(role, []).append(b)
        window = sum(st.window_s for st in stats.values())
        bubbles.append(max(0.0, 1 - sum(st.busy_s for st in stats.values()) / window) if window > 0 else 0.0)
        for w, st in stats.items():
            m = merged.setdefault(w, WorkerStats(w, st.role, st.gpu_type))
            for key in SUMMED:
                setattr(m, key, getattr(m, key) + getattr(st, key))
            peaks = [p for p in (m.peak_rss_mb, st.peak_rss_mb, rec.peak_rss_mb.get(w)) if p is not None]
            m.peak_rss_mb = max(peaks) if peaks else None
            gpu = [p for p in (m.peak_gpu_mb, st.peak_gpu_mb) if p is not None]
            m.peak_gpu_mb = max(gpu) if gpu else None
    return merged, bubbles, role_bubbles


def worker_rows(
    merged: dict[str, WorkerStats], pool: RatePool, group_size: int, tsp: bool
) -> tuple[list[dict[str, Any]], list[float], list[float]]:
    """bench.json's ``per_worker`` rows (by name) and the generation and training rates (samples/s)
    the bound takes: each worker's measured ones, else the pool's for its GPU type."""
    workers: list[dict[str, Any]] = []
    gens: list[float] = []
    trains: list[float] = []
    for w, st in sorted(merged.items()):
        g, t = st.gen_rate(group_size), st.train_rate(group_size)
        g_src, t_src = ("measured" if g else "pooled"), ("measured" if t else "pooled")
        g = g or pool.get(st.gpu_type, "gen", tsp) or 0.0
        t = t or pool.get(st.gpu_type, "train", tsp) or 0.0
        gens.append(g)
        trains.append(t)
        workers.append(
            {
                "worker": w,
                "role": st.role,
                "gpu_type": st.gpu_type,
                "gen_samples_per_s": round(g, 4),
                "gen_rate_source": g_src,
                "train_samples_per_s": round(t, 4),
                "train_rate_source": t_src,
                "gen_samples_per_cpu_s": _round(st.gen_cpu_rate(group_size)),
                "train_samples_per_cpu_s": _round(st.train_cpu_rate(group_size)),
                "busy_fraction": round(st.busy_s / st.window_s, 4) if st.window_s > 0 else None,
                "peak_rss_mb": round(st.peak_rss_mb, 1) if st.peak_rss_mb is not None else None,
                "peak_gpu_mb": round(st.peak_gpu_mb, 1) if st.peak_gpu_mb is not None else None,
            }
        )
    return workers, gens, trains


def _round(x: float | None) -> float | None:
    return round(x, 4) if x is not None else None


def cpu_worker_rates(
    merged: dict[str, WorkerStats], pool: RatePool, group_size: int, tsp: bool
) -> tuple[list[float], list[float]] | None:
    """Each worker's generation and training rates per CPU second (in :func:`worker_rows`'s
    order), the pool's for its GPU type where it measured none; None when some worker has a
    rate the tasks' CPU seconds cannot give (a row without ``cpu_s``)."""
    gens: list[float] = []
    trains: list[float] = []
    for _, st in sorted(merged.items()):
        if st.cpu_missing:
            return None
        g = st.gen_cpu_rate(group_size) or pool.get(st.gpu_type, "gen_cpu", tsp)
        t = st.train_cpu_rate(group_size) or pool.get(st.gpu_type, "train_cpu", tsp)
        wall_g = st.gen_rate(group_size) or pool.get(st.gpu_type, "gen", tsp)
        wall_t = st.train_rate(group_size) or pool.get(st.gpu_type, "train", tsp)
        if (wall_g and not g) or (wall_t and not t):
            return None
        gens.append(g or 0.0)
        trains.append(t or 0.0)
    return gens, trains


def startup_summary(profiles: list[dict]) -> dict:
    """A mode's start-up over its rounds: median seconds from the run's start to its first
    task and to the end of its first iteration, the median duration of each phase (the
    slowest worker's, for per-worker phases), the largest process-tree peaks and the
    per-process breakdown of the round with the largest PSS."""
    profiles = [p for p in profiles if p]
    durations: dict[str, list[float]] = {}
    for p in profiles:
        longest: dict[str, float] = {}
        for ph in p["phases"]:
            if ph["phase"] not in ("first task", "first iteration"):
                longest[ph["phase"]] = max(longest.get(ph["phase"], 0.0), float(ph["duration_s"]))
        for name, d in longest.items():
            durations.setdefault(name, []).append(d)

    def med(key: str) -> float | None:
        xs = [float(p[key]) for p in profiles if p.get(key) is not None]
        return round(median(xs), 3) if xs else None

    def peak(key: str) -> float | None:
        xs = [float(p[key]) for p in profiles if p.get(key) is not None]
        return max(xs) if xs else None

    top = max(profiles, key=lambda p: p.get("peak_tree_pss_mb") or 0.0, default={})
    return {
        "first_task_s": med("first_task_s"),
        "first_iteration_s": med("first_iteration_s"),
        "phase_s": {k: round(median(v), 3) for k, v in durations.items()},
        "peak_tree_rss_mb": peak("peak_tree_rss_mb"),
        "peak_tree_pss_mb": peak("peak_tree_pss_mb"),
        "peak_tree_processes": list(top.get("peak_tree_processes", [])),
        "first_iteration_vs_reference_s": None,
        "tree_pss_vs_reference": None,
    }


def add_startup_ratios(rows: list[dict]) -> None:
    """Fill each mode's start-up excess over ``reference`` (seconds to the end of the first
    iteration, and process-tree PSS as a ratio) where the reference ran."""
    ref = next((r["startup"] for r in rows if r["mode"] == "reference"), None)
    if ref is None:
        return
    for r in rows:
        st = r["startup"]
        if st.get("first_iteration_s") is not None and ref.get("first_iteration_s") is not None:
            st["first_iteration_vs_reference_s"] = round(
                st["first_iteration_s"] - ref["first_iteration_s"], 3
            )
        if st.get("peak_tree_pss_mb") and ref.get("peak_tree_pss_mb"):
            st["tree_pss_vs_reference"] = round(st["peak_tree_pss_mb"] / ref["peak_tree_pss_mb"], 3)


def eval_cost(records: list[RunRecord]) -> dict[str, float]:
    """Held-out evaluation per run: ``evaluations`` (``eval.jsonl`` rows) and ``eval_worker_s``
    (worker-seconds of its ``eval`` tasks on the timeline; the reference's inline evaluation
    is its rows' ``cost_s``)."""
    n, secs = 0, 0.0
    for rec in records:
        rows = _read_jsonl(rec.run_dir / "eval.jsonl")
        n += len(rows)
        tasks = [e for e in rec.timeline if e["kind"] == "eval"]
        secs += (
            sum(e["end"] - e["start"] for e in tasks) if tasks else sum(r.get("cost_s", 0.0) for r in rows)
        )
    runs = max(len(records), 1)
    return {"evaluations": n / runs, "eval_worker_s": secs / runs, **eval_interference_per_run(records)}


def eval_interference_per_run(records: list[RunRecord]) -> dict[str, float]:
    """:func:`digen.evaluation.eval_interference` of each run's timeline: sums per run, except
    the maxima (``eval_max_wait_s``, ``eval_max_task_s``: over all runs)."""
    from digen.evaluation import eval_interference

    per = [eval_interference(rec.timeline) for rec in records]
    if not per:
        return {}
    runs = len(per)
    out = {k: sum(p[k] for p in per) / runs for k in per[0]}
    out.update({k: max(p[k] for p in per) for k in ("eval_max_wait_s", "eval_max_task_s")})
    return out


def add_speedups(rows: list[dict]) -> None:
    """Fill ``speedup_vs_colocated`` / ``speedup_vs_disaggregated`` where those modes ran: a
    mode run at ``@B`` (``rollout.max_batch`` B) against the one at the same ``@B`` where it
    ran (``digen@4`` against ``colocated@4``), else against the plain one."""
    by_mode = {r["mode"]: r for r in rows}
    for base, key in (("colocated", "speedup_vs_colocated"), ("disaggregated", "speedup_vs_disaggregated")):
        for r in rows:
            at = r["mode"][r["mode"].rfind("@") :] if "@" in r["mode"] else ""
            ref = by_mode.get(base + at, by_mode.get(base))
            if ref is not None and ref["samples_per_s"] > 0:
                r[key] = r["samples_per_s"] / ref["samples_per_s"]
