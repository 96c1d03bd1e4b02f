"""Peak resident memory of the processes of a run (the bench process and its Dask workers),
sampled while they live."""

from __future__ import annotations

from pathlib import Path

from digen.startup import PeriodicSampler


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


class MemorySampler(PeriodicSampler):
    """Samples the peak RSS of named processes every ``period_s`` in a thread, until stopped
    (Dask workers exit when a run ends, so their peak is read while they live)."""

    def __init__(self, period_s: float = 0.25):
        super().__init__(period_s, "digen-bench-memory")
        self.pids: dict[str, int] = {}
        self.peaks: dict[str, float] = {}

    def watch(self, name: str, pid: int) -> None:
        self.pids[name] = pid

    def sample(self) -> None:
        for name, pid in list(self.pids.items()):
            p = peak_rss_mb(pid)
            if p is not None:
                self.peaks[name] = max(self.peaks.get(name, 0.0), p)
