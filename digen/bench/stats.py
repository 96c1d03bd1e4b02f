"""Reading a run back: what the bench keeps of it (:class:`RunRecord`) and each worker's task
counts, rates and busy time over the measured window (:func:`worker_stats`), the bubble per
role, and the pool of measured rates that fills in a rate a worker never measured."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

from digen.plots import ROLLOUT_KINDS, iteration_ends


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
    gen_cpu_s: float = 0.0
    """CPU seconds of the generation tasks' phases (their rows' ``cpu_s``, the thread that ran
    them: :func:`time.thread_time`), as ``gen_s`` is their wall seconds."""
    train_cpu_s: float = 0.0
    """CPU seconds of the train tasks, as ``train_s`` is their wall seconds."""
    cpu_missing: int = 0
    """Timed rows (generation or training) that recorded no ``cpu_s`` (a worker of an older
    digen): then the CPU rates are not given."""
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

    def gen_cpu_rate(self, group_size: int) -> float | None:
        """Samples per CPU second while generating: the rate of a worker that had its core to
        itself, whatever the machine's load (None where a row lacks ``cpu_s``)."""
        if self.cpu_missing or not self.gen_groups or self.gen_cpu_s <= 0:
            return None
        return group_size * self.gen_groups / self.gen_cpu_s

    def train_cpu_rate(self, group_size: int) -> float | None:
        """Samples per CPU second while training (None where a row lacks ``cpu_s``)."""
        if self.cpu_missing or not self.train_groups or self.train_cpu_s <= 0:
            return None
        return group_size * self.train_groups / self.train_cpu_s


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
        cpu = r.get("cpu_s")
        if kind in ROLLOUT_KINDS or kind == "train":
            st.cpu_missing += cpu is None
        if kind in ROLLOUT_KINDS:
            st.gen_s += e - s
            st.gen_cpu_s += float(cpu or 0.0)
            st.gen_groups += kind == "gen"
        elif kind == "train":
            st.train_s += e - s
            st.train_cpu_s += float(cpu or 0.0)
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


def median(xs: list[float]) -> float:
    """The median of ``xs``; 0 for none."""
    return float(statistics.median(xs)) if xs else 0.0


class RatePool:
    """Measured per-worker rates of every run, to fill in rates a worker never measured
    (a dedicated rollout worker never trains): the median by GPU type, for training also by
    the TSP setting (it changes the train task's speed) when that setting was measured."""

    def __init__(self) -> None:
        self.rates: dict[tuple[str, str, bool], list[float]] = {}

    def add(self, gpu: str, kind: str, tsp: bool, rate: float | None) -> None:
        """``kind``: ``gen`` or ``train`` (wall-clock rates), ``gen_cpu`` or ``train_cpu``
        (per CPU second)."""
        if rate is not None:
            self.rates.setdefault((gpu, kind, tsp if kind.startswith("train") else False), []).append(rate)

    def add_worker(self, st: WorkerStats, tsp: bool, group_size: int) -> None:
        """A worker's measured rates, wall-clock and per CPU second."""
        self.add(st.gpu_type, "gen", tsp, st.gen_rate(group_size))
        self.add(st.gpu_type, "train", tsp, st.train_rate(group_size))
        self.add(st.gpu_type, "gen_cpu", tsp, st.gen_cpu_rate(group_size))
        self.add(st.gpu_type, "train_cpu", tsp, st.train_cpu_rate(group_size))

    def get(self, gpu: str, kind: str, tsp: bool) -> float | None:
        tsp = tsp if kind.startswith("train") else False
        same = self.rates.get((gpu, kind, tsp)) or self.rates.get((gpu, kind, not tsp))
        return median(same) if same else None
