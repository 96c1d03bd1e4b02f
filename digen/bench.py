"""``digen bench``: the same workload in several schedule modes, side by side, on the local cluster.

Runs are *interleaved and repeated*: round 1 runs every mode once, round 2 again (in reverse
order, so slow drifts of the machine hit every mode alike), and so on. Each run is a normal
training run in its own run directory (``OUT/runs/<mode>/round_<r>``); the bench reads back
its ``metrics.jsonl`` and ``timeline.jsonl`` and reports per mode, over iterations
``>= warmup`` (iteration 0 includes model loading and worker start-up):

- ``samples_per_s``: median over all rounds' iterations of the per-iteration samples/s;
  ``s_per_iteration``: median iteration wall time;
- ``bubble_ratio`` (idle worker-seconds / worker-seconds, DESIGN.md section 3) overall and
  per role, from the timeline clipped to the measured window (a task running across an
  iteration boundary counts on both sides); ``bubble_ratio_metrics`` is the same from
  ``metrics.jsonl``'s ``busy_s``/``worker_s``;
- ``speedup_vs_colocated`` / ``speedup_vs_disaggregated``: ratio of ``samples_per_s``;
- ``bound_samples_per_s``: the zero-bubble bound of the mode's workers from their measured
  task durations (DESIGN.md section 4, :func:`digen.sim.bounds.lp_bound`) and
  ``fraction_of_bound``;
- per worker: measured generation and training rates, busy fraction and peak RSS;
- held-out evaluation's cost (``+eval`` / ``-eval`` on a mode turns ``eval`` on, with the
  config's ``eval.every`` or 1, or off): ``evaluations`` per run and ``eval_worker_s``, the
  worker-seconds its ``eval`` tasks took per run; run ``digen+eval,digen-eval`` side by side
  to read its effect on ``s_per_iteration``.
- ``worker_redis_round_trips_per_s`` / ``_per_cycle``: the requests the worker loops sent to
  Redis (counted by their client, :func:`digen.runtime.redis_conn.count_round_trips`) per
  second of the measured window, summed over workers, and per pass through a loop.

Plus the TSP micro-benchmark: one train task of K timesteps per sample as one batched
forward/backward (``tsp=True``) vs K sequential forwards (``tsp=False``), per K.
"""

from __future__ import annotations

import logging
import os
import shutil
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from digen.config import Config
from digen.errors import ConfigError
from digen.plots import iteration_ends
from digen.rundir import _read_jsonl
from digen.sim.bounds import lp_bound

log = logging.getLogger(__name__)

BASE_MODES = ("reference", "colocated", "disaggregated", "digen")
TOGGLES = {"gap": "gap", "tsp": "tsp", "tag": "tag", "rat": "rat", "async": "max_staleness", "eval": "eval"}
ROLLOUT_KINDS = ("gen", "decode", "reward")
Notify = Callable[[str], None]


# ---------------------------------------------------------------------------------------
# modes


def parse_modes(text: str) -> list[str]:
    """``"reference,digen,digen-tag"`` -> the list, validated. A mode is a base mode
    (reference, colocated, disaggregated, digen) with optional ``-toggle`` / ``+toggle``
    suffixes switching gap, tsp, tag, rat, async (staleness 1) or eval (held-out evaluation)
    off / on: ``digen-tag``, ``digen+eval``."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    if not modes:
        raise ConfigError("--modes is empty; e.g. --modes reference,colocated,disaggregated,digen")
    problems = []
    for m in modes:
        try:
            _mode_parts(m)
        except ValueError as exc:
            problems.append(str(exc))
    if len(set(modes)) != len(modes):
        problems.append(f"--modes ({text}) lists a mode twice")
    if problems:
        raise ConfigError(problems)
    return modes


def _mode_parts(mode: str) -> tuple[str, dict[str, Any]]:
    """``"digen-tag+gap"`` -> ``("digen", {"tag": False, "gap": True})``."""
    base, rest = mode, ""
    for i, ch in enumerate(mode):
        if ch in "+-":
            base, rest = mode[:i], mode[i:]
            break
    if base not in BASE_MODES:
        raise ValueError(f"mode {mode!r}: {base!r} is not one of {', '.join(BASE_MODES)}")
    toggles: dict[str, Any] = {}
    token, sign = "", ""
    for ch in rest + "+":
        if ch in "+-":
            if token:
                if token not in TOGGLES:
                    raise ValueError(f"mode {mode!r}: toggle {token!r} is not one of {', '.join(TOGGLES)}")
                key = TOGGLES[token]
                on = sign == "+"
                toggles[key] = (1 if on else 0) if key == "max_staleness" else on
            token, sign = "", ch
        else:
            token += ch
    if base == "reference" and set(toggles) - {"eval"}:
        raise ValueError(f"mode {mode!r}: reference takes no toggles but eval")
    return base, toggles


def parse_workers(text: str | None) -> tuple[int, int] | None:
    """``"1,1"`` -> (rollout workers, trainer workers); None keeps the config's."""
    if text is None:
        return None
    try:
        r, t = (int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(
            f"--workers ({text}) must be ROLLOUT,TRAINER worker counts, e.g. --workers 1,1"
        ) from None
    if r < 1 or t < 1:
        raise ConfigError(f"--workers ({text}): every mode needs at least 1 rollout and 1 trainer worker")
    return r, t


def mode_config(cfg: Config, mode: str, workers: tuple[int, int] | None = None) -> Config:
    """``cfg`` set to run ``mode``: its toggles, the worker counts, a checkpoint only at the end
    and no sample grids (disk writes are not what the bench measures)."""
    base, toggles = _mode_parts(mode)
    data = cfg.model_dump(mode="json")
    if "eval" in toggles:
        data["eval"]["every"] = (cfg.eval.every or 1) if toggles.pop("eval") else 0
    sched = data["schedule"]
    sched.update({"mode": base, "gap": None, "tsp": None, "tag": None, "rat": None, "max_staleness": None})
    sched.update(toggles)
    if workers is not None:
        data["cluster"]["local"].update({"rollout_workers": workers[0], "trainer_workers": workers[1]})
    data["output"].update({"checkpoint_every": cfg.iterations, "sample_grid_every": 0})
    data["logging"].update({"tensorboard": False, "wandb": False})
    out = Config.model_validate(data)
    out.source_dir = cfg.source_dir
    return out


# ---------------------------------------------------------------------------------------
# reading a run


@dataclass
class WorkerStats:
    """One worker of one run, over the measured window."""

    worker: str
    role: str
    gpu_type: str
    gen_groups: int = 0
    gen_s: float = 0.0
    train_groups: float = 0.0
    """Groups trained (a half group, RAT's unit, counts 0.5)."""
    train_s: float = 0.0
    busy_s: float = 0.0
    window_s: float = 0.0
    peak_rss_mb: float | None = None
    peak_gpu_mb: float | None = None
    redis_round_trips: int = 0
    """Requests the worker's loop sent to Redis (commands, pipelines, scripts) for its tasks."""
    cycles: int = 0
    """Passes through the worker's loop meanwhile (one per task, plus idle polls)."""

    def gen_rate(self, group_size: int) -> float | None:
        """Samples/s while generating (gen + decode + reward time per group)."""
        return group_size * self.gen_groups / self.gen_s if self.gen_groups and self.gen_s > 0 else None

    def train_rate(self, group_size: int) -> float | None:
        """Samples/s while training (train task time per group)."""
        return (
            group_size * self.train_groups / self.train_s if self.train_groups and self.train_s > 0 else None
        )


@dataclass
class RunRecord:
    """What the bench keeps of one run."""

    mode: str
    round: int
    run_dir: Path
    metrics: list[dict]
    timeline: list[dict]
    tsp: bool
    peak_rss_mb: dict[str, float] = field(default_factory=dict)
    startup: dict = field(default_factory=dict)
    """The run's start-up profile (:meth:`digen.startup.StartupProfile.to_json`), its clock
    starting when the run starts (the bench process has imported everything by then)."""


def measured_window(timeline: list[dict], warmup: int) -> tuple[float, float]:
    """[start, end] of iterations ``>= warmup``: from the end of iteration ``warmup - 1``
    (its optimizer step) to the end of the last iteration."""
    ends = iteration_ends(timeline)
    if not ends:
        return 0.0, 0.0
    end = ends[max(ends)]
    if warmup <= 0 or (warmup - 1) not in ends:
        return min(float(r["start"]) for r in timeline), end
    return ends[warmup - 1], end


def worker_stats(timeline: list[dict], warmup: int) -> dict[str, WorkerStats]:
    """Per worker (the controller excluded): task counts and times of iterations >= warmup,
    busy time (non-``sync`` tasks) clipped to the measured window, and the worker's main role."""
    lo, hi = measured_window(timeline, warmup)
    out: dict[str, WorkerStats] = {}
    role_counts: dict[str, dict[str, int]] = {}
    for r in timeline:
        w = str(r["worker"])
        if w == "controller":
            continue
        st = out.setdefault(
            w, WorkerStats(w, str(r.get("role", "?")), str(r.get("gpu_type", "?")), window_s=hi - lo)
        )
        counts = role_counts.setdefault(w, {})
        counts[str(r.get("role", "?"))] = counts.get(str(r.get("role", "?")), 0) + 1
        for key in ("peak_rss_mb", "peak_gpu_mb"):  # recorded by the worker, when it does
            if r.get(key) is not None:
                setattr(st, key, max(getattr(st, key) or 0.0, float(r[key])))
        s, e, kind = float(r["start"]), float(r["end"]), str(r["kind"])
        if kind != "sync":
            st.busy_s += max(0.0, min(e, hi) - max(s, lo))
        if int(r["iteration"]) < warmup:
            continue
        st.redis_round_trips += int(r.get("redis_round_trips", 0))  # on a task's last event
        st.cycles += int(r.get("cycles", 0))
        if kind in ROLLOUT_KINDS:
            st.gen_s += e - s
            st.gen_groups += kind == "gen"
        elif kind == "train":
            st.train_s += e - s
            st.train_groups += float(r.get("share", 1.0))
    for w, counts in role_counts.items():
        out[w].role = max(counts, key=lambda k: counts[k])
    return out


def bubble_by_role(stats: dict[str, WorkerStats]) -> dict[str, float]:
    """1 - busy / (workers x window) per role."""
    roles: dict[str, list[WorkerStats]] = {}
    for st in stats.values():
        roles.setdefault(st.role, []).append(st)
    return {
        role: max(0.0, 1 - sum(s.busy_s for s in ws) / sum(s.window_s for s in ws))
        if sum(s.window_s for s in ws) > 0
        else 0.0
        for role, ws in sorted(roles.items())
    }


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else 0.0


class RatePool:
    """Measured per-worker rates of every run, to fill in rates a worker never measured
    (a dedicated rollout worker never trains): the median by GPU type, for training also by
    the TSP setting (it changes the train task's speed) when that setting was measured."""

    def __init__(self) -> None:
        self.rates: dict[tuple[str, str, bool], list[float]] = {}

    def add(self, gpu: str, kind: str, tsp: bool, rate: float | None) -> None:
        if rate is not None:
            self.rates.setdefault((gpu, kind, tsp if kind == "train" else False), []).append(rate)

    def get(self, gpu: str, kind: str, tsp: bool) -> float | None:
        tsp = tsp if kind == "train" else False
        same = self.rates.get((gpu, kind, tsp)) or self.rates.get((gpu, kind, not tsp))
        return _median(same) if same else None


def summarize(mode: str, records: list[RunRecord], pool: RatePool, group_size: int, warmup: int) -> dict:
    """bench.json's object for one mode (all its rounds)."""
    rows = [m for rec in records for m in rec.metrics if int(m["iteration"]) >= warmup]
    if not rows:
        raise ConfigError(
            f"mode {mode}: no iteration >= --warmup {warmup}; raise iterations or lower --warmup"
        )
    per_round = [
        _median([float(m["samples_per_s"]) for m in rec.metrics if int(m["iteration"]) >= warmup])
        for rec in records
    ]
    busy, worker_s = (
        sum(float(m.get("busy_s", 0.0)) for m in rows),
        sum(float(m.get("worker_s", 0.0)) for m in rows),
    )
    # per worker: pooled over rounds (same worker names every round)
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
            for key in (
                "gen_groups",
                "gen_s",
                "train_groups",
                "train_s",
                "busy_s",
                "window_s",
                "redis_round_trips",
                "cycles",
            ):
                setattr(m, key, getattr(m, key) + getattr(st, key))
            peaks = [p for p in (m.peak_rss_mb, st.peak_rss_mb, rec.peak_rss_mb.get(w)) if p is not None]
            m.peak_rss_mb = max(peaks) if peaks else None
            gpu = [p for p in (m.peak_gpu_mb, st.peak_gpu_mb) if p is not None]
            m.peak_gpu_mb = max(gpu) if gpu else None
    workers: list[dict[str, Any]] = []
    gens: list[float] = []
    trains: list[float] = []
    tsp = records[0].tsp
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
                "busy_fraction": round(st.busy_s / st.window_s, 4) if st.window_s > 0 else None,
                "peak_rss_mb": round(st.peak_rss_mb, 1) if st.peak_rss_mb is not None else None,
                "peak_gpu_mb": round(st.peak_gpu_mb, 1) if st.peak_gpu_mb is not None else None,
            }
        )
    solution = lp_bound(gens, trains)
    bound = solution.x
    for wd, f in zip(workers, solution.fractions, strict=True):
        wd["bound_gen_fraction"] = round(f, 4)
    sps = _median([float(m["samples_per_s"]) for m in rows])
    trips, cycles = sum(m.redis_round_trips for m in merged.values()), sum(m.cycles for m in merged.values())
    window_s = sum(m.window_s for m in merged.values())
    ctl_peak = [rec.peak_rss_mb["controller"] for rec in records if "controller" in rec.peak_rss_mb]
    return {
        "mode": mode,
        "workers": len(workers),
        "iterations_measured": len(rows),
        "rounds": len(records),
        "s_per_iteration": _median([float(m["wall_s"]) for m in rows]),
        "samples_per_s": sps,
        "samples_per_s_rounds": per_round,
        "bubble_ratio": _median(bubbles),
        "bubble_ratio_by_role": {r: _median(bs) for r, bs in role_bubbles.items()},
        "bubble_ratio_metrics": max(0.0, 1 - busy / worker_s) if worker_s > 0 else 0.0,
        "speedup_vs_colocated": None,
        "speedup_vs_disaggregated": None,
        "bound_samples_per_s": bound,
        "fraction_of_bound": sps / bound if bound > 0 else None,
        "controller_peak_rss_mb": round(max(ctl_peak), 1) if ctl_peak else None,
        "startup": startup_summary([rec.startup for rec in records]),
        **eval_cost(records),
        "worker_redis_round_trips_per_s": round(trips / window_s, 2) if trips and window_s > 0 else None,
        "worker_redis_round_trips_per_cycle": round(trips / cycles, 3) if cycles else None,
        "per_worker": workers,
        "run_dirs": [str(rec.run_dir) for rec in records],
    }


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
        return round(_median(xs), 3) if xs else None

    def peak(key: str) -> float | None:
        xs = [float(p[key]) for p in profiles if p.get(key) is not None]
        return max(xs) if xs else None

    top = max(profiles, key=lambda p: p.get("peak_tree_pss_mb") or 0.0, default={})
    return {
        "first_task_s": med("first_task_s"),
        "first_iteration_s": med("first_iteration_s"),
        "phase_s": {k: round(_median(v), 3) for k, v in durations.items()},
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


def add_speedups(rows: list[dict]) -> None:
    """Fill ``speedup_vs_colocated`` / ``speedup_vs_disaggregated`` where those modes ran."""
    by_mode = {r["mode"]: r for r in rows}
    for base, key in (("colocated", "speedup_vs_colocated"), ("disaggregated", "speedup_vs_disaggregated")):
        ref = by_mode.get(base)
        for r in rows:
            if ref is not None and ref["samples_per_s"] > 0:
                r[key] = r["samples_per_s"] / ref["samples_per_s"]


# ---------------------------------------------------------------------------------------
# peak memory


def peak_rss_mb(pid: int) -> float | None:
    """Peak resident set size of a process in MiB (``VmHWM``; current RSS where /proc lacks it)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    try:
        import psutil

        return psutil.Process(pid).memory_info().rss / 2**20
    except Exception:  # noqa: BLE001 - the process is gone or psutil is missing
        return None


def reset_peak_rss() -> bool:
    """Reset this process's ``VmHWM`` to its current RSS (Linux ``clear_refs``); False if not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class MemorySampler:
    """Samples the peak RSS of named processes every ``period_s`` in a thread, until stopped
    (Dask workers exit when a run ends, so their peak is read while they live)."""

    def __init__(self, period_s: float = 0.25):
        self.period_s = period_s
        self.pids: dict[str, int] = {}
        self.peaks: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="digen-bench-memory")

    def watch(self, name: str, pid: int) -> None:
        self.pids[name] = pid

    def _sample(self) -> None:
        for name, pid in list(self.pids.items()):
            p = peak_rss_mb(pid)
            if p is not None:
                self.peaks[name] = max(self.peaks.get(name, 0.0), p)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._sample()

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


# ---------------------------------------------------------------------------------------
# running


def run_one(
    cfg: Config, out: Path, mode: str, round_: int, *, redis_url: str | None = None, plots: bool = False
) -> RunRecord:
    """One training run of ``cfg`` in ``out`` (wiped first), with its peak memory per process;
    ``plots`` draws its timeline.png and rewards.png afterwards."""
    from digen.startup import StartupProfile, TreeMemorySampler, profiling

    if out.exists():
        shutil.rmtree(out)
    reset_peak_rss()
    profile = StartupProfile(t0=time.time())
    with MemorySampler() as mem, TreeMemorySampler() as tree, profiling(profile):
        mem.watch("controller", os.getpid())
        if cfg.schedule.mode == "reference":
            _run_reference(cfg, out)
        else:
            from digen.runtime.controller import run_distributed

            def on_start(ctl) -> None:
                pids = ctl.client.run(os.getpid)  # {address: pid}
                for name, w in ctl.workers.items():
                    if w.address in pids:
                        mem.watch(name, int(pids[w.address]))
                        tree.name(int(pids[w.address]), name)

            run_distributed(cfg, out, redis_url=redis_url, on_start=on_start)
    peaks = dict(mem.peaks)
    if plots:
        from digen.plots import write_run_plots

        write_run_plots(out)
    if cfg.schedule.mode == "reference":  # the trainer is this process
        peaks["reference"] = peaks["controller"]
    timeline = _read_jsonl(out / "timeline.jsonl")
    return RunRecord(
        mode,
        round_,
        out,
        _read_jsonl(out / "metrics.jsonl"),
        timeline,
        bool(cfg.schedule.resolved().tsp),
        peaks,
        profile.to_json(timeline, tree.peak_mb, tree.peak_pss_mb, tree.peak_breakdown()),
    )


def _run_reference(cfg: Config, out: Path) -> None:
    """The reference loop with the thread count of one worker (it is one worker)."""
    import torch

    from digen.reference import run_reference

    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.cluster.local.threads_per_worker)
    try:
        run_reference(cfg, out)
    finally:
        torch.set_num_threads(threads)


@contextmanager
def _private_redis(out: Path, needed: bool) -> Iterator[str | None]:
    """An embedded Redis of the bench's own (``OUT/redis``), so no other digen process on
    the machine shares, slows or stops the server the runs use; None when not needed."""
    if not needed:
        yield None
        return
    from digen.runtime.redis_conn import connect, embedded_url, stop_embedded

    db = (out / "redis" / "bench.db").resolve()
    try:
        yield embedded_url(connect(None, db_path=db))
    finally:
        stop_embedded(db)


@dataclass
class BenchResult:
    rows: list[dict]
    tsp: list[dict]
    records: list[RunRecord]


def run_bench(
    cfg: Config,
    modes: list[str],
    out: Path,
    *,
    rounds: int = 2,
    warmup: int = 1,
    workers: tuple[int, int] | None = None,
    tsp_ks: Sequence[int] = (1, 2, 4, 8),
    notify: Notify | None = None,
) -> BenchResult:
    """Run every mode ``rounds`` times, interleaved; summarize; run the TSP micro-benchmark.

    Writes nothing but the runs' directories under ``out/runs``; see :func:`write_outputs`.
    """
    if rounds < 1:
        raise ConfigError(f"--rounds ({rounds}) must be at least 1")
    if warmup < 0 or warmup >= cfg.iterations:
        raise ConfigError(f"--warmup ({warmup}) must lie in [0, iterations) = [0, {cfg.iterations})")
    notify = notify or (lambda _msg: None)
    configs = {m: mode_config(cfg, m, workers) for m in modes}
    records: list[RunRecord] = []
    with _private_redis(out, any(c.schedule.mode != "reference" for c in configs.values())) as redis_url:
        for r in range(rounds):
            order = modes if r % 2 == 0 else list(reversed(modes))
            for m in order:
                t0 = time.time()
                rec = run_one(
                    configs[m],
                    out / "runs" / m / f"round_{r}",
                    m,
                    r,
                    redis_url=redis_url,
                    plots=cfg.output.plots and r == rounds - 1,
                )
                records.append(rec)
                sps = _median(
                    [float(x["samples_per_s"]) for x in rec.metrics if int(x["iteration"]) >= warmup]
                )
                notify(f"round {r + 1}/{rounds} {m}: {time.time() - t0:.1f} s, {sps:.2f} samples/s (median)")
    pool = RatePool()
    for rec in records:
        for st in worker_stats(rec.timeline, warmup).values():
            pool.add(st.gpu_type, "gen", rec.tsp, st.gen_rate(cfg.rollout.group_size))
            pool.add(st.gpu_type, "train", rec.tsp, st.train_rate(cfg.rollout.group_size))
    rows = [
        summarize(m, [rec for rec in records if rec.mode == m], pool, cfg.rollout.group_size, warmup)
        for m in modes
    ]
    add_speedups(rows)
    add_startup_ratios(rows)
    tsp = []
    if tsp_ks:
        notify(f"TSP micro-benchmark, K in {list(tsp_ks)}")
        tsp = tsp_microbench(cfg, tsp_ks)
    return BenchResult(rows, tsp, records)


# ---------------------------------------------------------------------------------------
# TSP micro-benchmark


def tsp_microbench(cfg: Config, ks: Sequence[int] = (1, 2, 4, 8), repeats: int = 5) -> list[dict]:
    """Time one train task (a group x K timesteps per sample) batched vs sequential, per K.

    The rows come from one real generated group of ``cfg``'s model; K is capped at
    ``rollout.num_steps``. Times are medians of ``repeats`` alternating runs after a warm-up.
    """
    import torch

    from digen.assembly import EmbedCache, build_policy, build_reward
    from digen.rollout import generate_group, plan_groups
    from digen.training import build_rows, task_gradient

    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.cluster.local.threads_per_worker)
    try:
        policy = build_policy(cfg)
        embed = EmbedCache(policy, cfg.rollout.guidance_scale > 1.0)
        task = plan_groups(cfg, cfg.prompt_list(), 0, 0)[0]
        traj = generate_group(policy, task, cfg, build_reward(cfg), embeds=embed(task.prompt))
        n = len(task.sample_ids)
        embeds = embed(task.prompt).repeat_rows(n)
        adv = torch.linspace(-1, 1, n)
        out = []
        for k_req in ks:
            k = min(int(k_req), cfg.rollout.num_steps)
            rows = build_rows(
                traj.latents, torch.nan_to_num(traj.log_probs), traj.sigmas, adv, [list(range(k))] * n
            )
            data = cfg.model_dump(mode="json")
            data["train"]["rows_per_forward"] = max(cfg.train.rows_per_forward, len(rows))
            cfg_k = Config.model_validate(data)
            times: dict[bool, list[float]] = {True: [], False: []}
            for i in range(repeats + 1):
                for tsp in (True, False):
                    t0 = time.perf_counter()
                    task_gradient(policy, rows, embeds, cfg_k, tsp=tsp, sigma_max=float(traj.sigmas[1]))
                    if i > 0:  # the first round warms up both paths
                        times[tsp].append(time.perf_counter() - t0)
            batched, sequential = _median(times[True]), _median(times[False])
            out.append(
                {
                    "K": k,
                    "rows": len(rows),
                    "batched_s": batched,
                    "sequential_s": sequential,
                    "batched_ms_per_row": 1e3 * batched / len(rows),
                    "sequential_ms_per_row": 1e3 * sequential / len(rows),
                    "speedup": sequential / batched if batched > 0 else None,
                }
            )
        return out
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------
# outputs


def _fmt(x: float | None, spec: str, suffix: str = "") -> str:
    return "n/a" if x is None else format(x, spec) + suffix


def markdown_table(
    rows: list[dict],
    tsp: list[dict],
    *,
    command: str | None = None,
    rounds: int | None = None,
    warmup: int | None = None,
) -> str:
    """The bench result as Markdown: one table of modes, one of the TSP micro-benchmark."""
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
            f"| {_fmt(r['fraction_of_bound'], '.0%')} | {rss} |"
        )
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
    return "\n".join(lines) + "\n"


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


def write_outputs(
    result: BenchResult,
    out: Path,
    *,
    command: str | None = None,
    rounds: int | None = None,
    warmup: int | None = None,
) -> dict[str, Path]:
    """``bench.json`` (one object per mode), ``tsp.json`` and ``bench.md`` in ``out``."""
    import json

    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "bench.json", "tsp": out / "tsp.json", "markdown": out / "bench.md"}
    paths["json"].write_text(json.dumps(result.rows, indent=1))
    paths["tsp"].write_text(json.dumps(result.tsp, indent=1))
    paths["markdown"].write_text(
        markdown_table(result.rows, result.tsp, command=command, rounds=rounds, warmup=warmup)
    )
    return paths
