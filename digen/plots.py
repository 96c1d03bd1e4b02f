"""Charts of a run (matplotlib, Agg backend): ``timeline.png`` and ``rewards.png``.

``timeline.png`` is a Gantt chart with one lane per worker (labelled with its role(s) and GPU
type). A bar is one row of ``timeline.jsonl``, colored by task kind; odd iterations are drawn
lighter so iterations can be told apart, dashed lines mark where each iteration's optimizer
step ended, and rollout work generated with an older policy than its iteration (staleness
``iteration - version >= 1``) is hatched. ``rewards.png`` plots the reward mean with a
+-1 std band, and the PPO diagnostics (approx KL, clip fraction, KL to the reference).

Both functions take plain rows (the dicts of the jsonl files), so tests and the report can
draw synthetic or in-memory runs; ``out`` is a path or a binary file object.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from digen.rundir import _read_jsonl

KIND_COLORS = {
    "gen": "#1f77b4",
    "decode": "#17becf",
    "reward": "#2ca02c",
    "train": "#ff7f0e",
    "optim": "#d62728",
    "sync": "#7f7f7f",
    "eval": "#bcbd22",
}
OTHER_COLOR = "#9467bd"
ROLLOUT_KINDS = ("gen", "decode", "reward")
_ROLE_ORDER = {"reference": 0, "colocated": 1, "rollout": 2, "trainer": 3, "reward": 4, "controller": 9}

Out = str | Path | IO[bytes]


@dataclass(frozen=True)
class TimelinePlot:
    """What :func:`plot_timeline` drew in its main panel, read back from the figure: ``bars``
    rectangles, ``lanes`` labels top to bottom, bars per lane (keyed by worker) and hatched bars."""

    bars: int
    lanes: list[str]
    bars_per_lane: dict[str, int]
    stale_bars: int


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def staleness(row: dict[str, Any]) -> int:
    """Policy lag of a rollout row (``iteration - version``); 0 for every other kind."""
    if row.get("kind") not in ROLLOUT_KINDS:
        return 0
    return max(0, int(row["iteration"]) - int(row["version"]))


def worker_lanes(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """``(worker, label)`` per lane, top to bottom: workers ordered by role, then name; the
    label names the roles the worker ran tasks under and its GPU type. A sequence-parallel
    replica (rows with ``ranks``, under its leader's name) is one lane naming its other ranks."""
    roles: dict[str, list[str]] = {}
    gpus: dict[str, str] = {}
    peers: dict[str, list[str]] = {}
    for r in rows:
        w = str(r["worker"])
        seen = roles.setdefault(w, [])
        if r.get("role") and r["role"] not in seen:
            seen.append(str(r["role"]))
        gpus.setdefault(w, str(r.get("gpu_type", "?")))
        for p in r.get("ranks", [])[1:]:
            if p not in peers.setdefault(w, []):
                peers[w].append(str(p))

    def key(w: str) -> tuple[int, str]:
        return (min((_ROLE_ORDER.get(x, 5) for x in roles[w]), default=5), w)

    def name(w: str) -> str:
        return f"{w} + {', '.join(peers[w])} (sp)" if peers.get(w) else w

    return [(w, f"{name(w)}\n{'/'.join(roles[w]) or '?'} · {gpus[w]}") for w in sorted(roles, key=key)]


def iteration_ends(rows: list[dict[str, Any]]) -> dict[int, float]:
    """End time of each iteration: the end of its last ``optim``/``sync`` on the controller
    (or of its last task when no controller row exists, as in the reference trainer)."""
    ends: dict[int, float] = {}
    ctl = [r for r in rows if r["worker"] == "controller"]
    for r in ctl or rows:
        k = int(r["iteration"])
        ends[k] = max(ends.get(k, float("-inf")), float(r["end"]))
    return ends


def plot_timeline(rows: list[dict[str, Any]], out: Out, *, title: str | None = None) -> TimelinePlot:
    """Draw ``timeline.jsonl`` rows as a Gantt chart (one bar per row) into ``out`` (PNG).

    When the first iteration (model loading, warm-up) takes most of the run, a second panel
    zooms on the later iterations. Returns what the main panel drew, counted from the figure
    itself (bars, lane labels, hatched bars).
    """
    plt = _pyplot()
    from matplotlib.patches import Patch

    lanes = worker_lanes(rows)
    t0 = min((float(r["start"]) for r in rows), default=0.0)
    t1 = max((float(r["end"]) for r in rows), default=1.0)
    ends = iteration_ends(rows)
    zoom_from = _zoom_start(ends, t0, t1)
    n_ax = 2 if zoom_from is not None else 1
    fig_h = 1.0 + n_ax * (0.4 + 0.55 * max(len(lanes), 1))
    fig, axes = plt.subplots(n_ax, 1, figsize=(12, fig_h), dpi=100, squeeze=False)
    ax = axes[0][0]
    _draw_lanes(ax, rows, lanes, ends, t0, t0, t1)
    ax.set_title(title or f"timeline: {len(rows)} tasks, {len(ends)} iterations", fontsize=10)
    if zoom_from is not None:
        zoom = axes[1][0]
        shown = [r for r in rows if float(r["end"]) > zoom_from]
        _draw_lanes(zoom, shown, lanes, ends, t0, zoom_from, t1)
        zoom.set_title(f"zoom: after iteration {min(ends)} (warm-up, model loading)", fontsize=9)
    axes[-1][0].set_xlabel("seconds since the first task")
    kinds = sorted(
        {str(r["kind"]) for r in rows}, key=lambda k: list(KIND_COLORS).index(k) if k in KIND_COLORS else 99
    )
    handles = [Patch(color=KIND_COLORS.get(k, OTHER_COLOR), label=k) for k in kinds]
    handles.append(Patch(facecolor="white", edgecolor="black", hatch="////", label="stale (older policy)"))
    handles.append(Patch(color="#1f77b4", alpha=0.55, label="odd iteration"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()

    patches = [p for c in ax.containers for p in c.patches]
    per_lane = {w: 0 for w, _ in lanes}
    for p in patches:
        per_lane[lanes[round(p.get_y() + p.get_height() / 2)][0]] += 1
    drawn = TimelinePlot(
        bars=len(patches),
        lanes=[t.get_text() for t in ax.get_yticklabels()],
        bars_per_lane=per_lane,
        stale_bars=sum(1 for p in patches if p.get_hatch()),
    )
    fig.savefig(out, format="png")
    plt.close(fig)
    return drawn


def _zoom_start(ends: dict[int, float], t0: float, t1: float) -> float | None:
    """Where a zoom panel starts (end of the first iteration), or None when not needed."""
    if len(ends) < 2:
        return None
    first_end = ends[min(ends)]
    return first_end if first_end - t0 > 0.4 * (t1 - t0) else None


def _draw_lanes(
    ax,
    rows: list[dict[str, Any]],
    lanes: list[tuple[str, str]],
    ends: dict[int, float],
    t0: float,
    lo: float,
    hi: float,
) -> None:
    """One bar per row on ``ax``, x from ``lo - t0`` to ``hi - t0`` seconds."""
    lane_of = {w: i for i, (w, _) in enumerate(lanes)}
    span = max(hi - lo, 1e-9)
    min_w = span * 1e-3  # a task shorter than this is widened to stay visible
    # one barh call per (kind, odd iteration, stale) style; ax.containers holds them all
    groups: dict[tuple[str, bool, bool], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((str(r["kind"]), int(r["iteration"]) % 2 == 1, staleness(r) > 0), []).append(r)
    for (kind, odd, stale), rs in sorted(groups.items()):
        ax.barh(
            [lane_of[str(r["worker"])] for r in rs],
            [max(float(r["end"]) - float(r["start"]), min_w) for r in rs],
            left=[float(r["start"]) - t0 for r in rs],
            height=0.7,
            color=KIND_COLORS.get(kind, OTHER_COLOR),
            alpha=0.55 if odd else 1.0,
            hatch="////" if stale else None,
            edgecolor="black" if stale else "none",
            linewidth=0.3,
        )
    last_label = float("-inf")
    for k, end in sorted(ends.items()):
        if end <= lo:
            continue
        ax.axvline(end - t0, color="black", linestyle=":", linewidth=0.7)
        if end - last_label > 0.04 * span:  # skip labels that would overlap
            ax.text(end - t0, -0.55, f"it {k} ", fontsize=7, va="bottom", ha="right")
            last_label = end
    ax.set_yticks(range(len(lanes)), [label for _, label in lanes], fontsize=8)
    ax.set_ylim(len(lanes) - 0.4, -0.8)
    ax.set_xlim(lo - t0, lo - t0 + span * 1.09)
    _label_busy(ax, rows, lanes, lo, hi)


def _label_busy(ax, rows: list[dict[str, Any]], lanes: list[tuple[str, str]], lo: float, hi: float) -> None:
    """Write each lane's busy fraction in [lo, hi] (non-``sync`` task time) at its right end."""
    span = max(hi - lo, 1e-9)
    for i, (w, _) in enumerate(lanes):
        busy = sum(
            max(0.0, min(float(r["end"]), hi) - max(float(r["start"]), lo))
            for r in rows
            if r["worker"] == w and r["kind"] != "sync"
        )
        ax.annotate(
            f"busy {busy / span:.0%}",
            xy=(1.0, i),
            xycoords=("axes fraction", "data"),
            xytext=(-48, 0),
            textcoords="offset points",
            fontsize=7,
            va="center",
        )


def plot_rewards(rows: list[dict[str, Any]], out: Out, *, title: str | None = None) -> int:
    """Reward mean +- std per iteration (top) and approx KL / clip fraction / KL (bottom).

    ``rows`` are ``metrics.jsonl`` objects. Returns the number of iterations plotted.
    """
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    rows = sorted(rows, key=lambda r: int(r["iteration"]))
    it = [int(r["iteration"]) for r in rows]
    mean, std = _series(rows, "reward_mean", float("nan")), _series(rows, "reward_std")
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), dpi=100, sharex=True)
    top.plot(it, mean, marker="o", markersize=3, color="#1f77b4", label="reward mean")
    top.fill_between(
        it,
        [m - s for m, s in zip(mean, std, strict=True)],
        [m + s for m, s in zip(mean, std, strict=True)],
        color="#1f77b4",
        alpha=0.2,
        label="± 1 std",
    )
    top.set_ylabel("reward")
    top.xaxis.set_major_locator(MaxNLocator(integer=True))
    top.legend(fontsize=8, loc="best")
    top.grid(alpha=0.3)
    top.set_title(title or f"rewards over {len(rows)} iterations", fontsize=10)

    bottom.plot(it, _series(rows, "approx_kl"), marker=".", color="#d62728", label="approx KL (old policy)")
    kl = _series(rows, "kl")
    if any(kl):
        bottom.plot(it, kl, linestyle="--", color="#8c564b", label="KL to reference")
    bottom.set_ylabel("KL")
    bottom.set_xlabel("iteration")
    bottom.grid(alpha=0.3)
    right = bottom.twinx()
    right.plot(it, _series(rows, "clipfrac"), marker=".", color="#ff7f0e", label="clip fraction")
    right.set_ylabel("clip fraction")
    right.set_ylim(bottom=0)
    lines = bottom.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    bottom.legend(lines, [ln.get_label() for ln in lines], fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(out, format="png")
    plt.close(fig)
    return len(rows)


def _series(rows: list[dict[str, Any]], key: str, missing: float = 0.0) -> list[float]:
    """``key`` of every metrics row as a float (``missing`` where a row lacks it)."""
    return [float(r.get(key, missing)) for r in rows]


def write_run_plots(run_dir: str | Path) -> list[Path]:
    """Write ``timeline.png`` and ``rewards.png`` of a run directory from its jsonl files;
    returns the paths written (a file with no rows is skipped)."""
    root = Path(run_dir)
    written = []
    timeline = _read_jsonl(root / "timeline.jsonl")
    if timeline:
        plot_timeline(timeline, root / "timeline.png")
        written.append(root / "timeline.png")
    metrics = _read_jsonl(root / "metrics.jsonl")
    if metrics:
        plot_rewards(metrics, root / "rewards.png")
        written.append(root / "rewards.png")
    return written
