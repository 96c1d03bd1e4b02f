"""Simulation reports: the per-mode table, the Markdown results table of many studies, and a
Gantt chart (PNG, matplotlib Agg) of one simulated iteration per mode.

Pure functions returning strings or writing files; the CLI prints them.
"""

from __future__ import annotations

from pathlib import Path

from digen.plots import KIND_COLORS, OTHER_COLOR
from digen.sim.costmodel import SpChoice
from digen.sim.driver import LADDER, PEERS, time_shares
from digen.sim.measure import DATAPLANE_PARTS, SimResult, measured_window
from digen.sim.study import Study

DATAPLANE_HEADERS = ["reduce s", "step s", "distribute s", "trajectory s"]
"""The data plane's seconds per iteration (:func:`digen.sim.driver.dataplane_per_iteration`)."""
TABLE_HEADERS = [
    "mode",
    "s/iteration",
    "samples/s",
    "samples/s/GPU",
    "bubble",
    "speedup vs colocated",
    "fraction of bound",
    "rollout/trainer GPUs",
    *DATAPLANE_HEADERS,
]


def dataplane_cells(sim: SimResult) -> list[str]:
    """The :data:`DATAPLANE_HEADERS` cells of a result ("-": the mode has no such transfer)."""
    return [_seconds(sim.dataplane.get(key, 0.0)) for key in DATAPLANE_PARTS.values()]


def _seconds(x: float) -> str:
    return "-" if x <= 0 else f"{x:.3f}" if x >= 0.001 else f"{x:.1e}"


def table_rows(study: Study) -> list[list[str]]:
    """One row per mode, formatted (columns: :data:`TABLE_HEADERS`)."""
    rows = []
    for r in study.results:
        s = r.sim
        split = "-" if r.rollout_gpus == 0 and r.trainer_gpus == 0 else f"{r.rollout_gpus}/{r.trainer_gpus}"
        rows.append(
            [
                r.mode,
                f"{s.s_per_iteration:.1f}",
                f"{s.samples_per_s:.4g}",
                f"{s.samples_per_s_per_gpu:.4g}",
                f"{s.bubble_ratio:.3f}",
                f"{r.speedup_vs_colocated:.2f}x",
                f"{r.fraction_of_bound:.3f}",
                split,
                *dataplane_cells(s),
            ]
        )
    return rows


def text_table(study: Study) -> str:
    """The per-mode table as Markdown (also readable as plain text)."""
    return _markdown(TABLE_HEADERS, table_rows(study))


def json_rows(study: Study) -> list[dict]:
    """``digen simulate --json``: one object per mode (the metrics of docs/architecture.md, "metrics.jsonl", first)."""
    return [r.to_json() for r in study.results]


def _markdown(headers: list[str], rows: list[list[str]]) -> str:
    lines = [
        "| " + " | ".join(headers) + " |",
        "|" + "|".join("---" if i == 0 else "---:" for i in range(len(headers))) + "|",
    ]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def markdown_results(studies: list[tuple[str, str, Study]]) -> str:
    """The results table: one row per (workload, testbed): each peer's s/iteration (the
    peers restated from their code, :mod:`digen.sim.peers`) and digen's, digen's speedup over
    each peer and over the ``colocated`` strawman, its fraction of the bound, the ablation
    ladder's speedups over colocated, and digen's own colocated mode when simulated."""
    peers = [
        p
        for p in PEERS
        if any(r.mode == p for _, _, st in studies for r in st.results)
        or any(p in st.no_pipeline for _, _, st in studies)
    ]
    headers = [
        "workload",
        "testbed",
        "GPUs",
        *[f"{p} s/it" for p in peers],
        "digen s/it",
        *[f"digen vs {p}" for p in peers],
        "digen vs colocated",
        "digen / bound",
        *LADDER[:-1],
        "colocated-digen",
        "ladder monotone",
    ]
    rows = []
    for workload, testbed, st in studies:
        got = {r.mode: r for r in st.results}
        col, dg = st.colocated, got.get("digen")
        if col is None or dg is None:
            continue
        speeds = [got[m].sim.samples_per_s for m in LADDER if m in got]
        monotone = all(b >= a * (1 - 1e-9) for a, b in zip(speeds, speeds[1:], strict=False))
        rows.append(
            [
                workload,
                testbed,
                str(st.cost.gpu_count),
                *[
                    _peer_cell(got, st, p, f"{got[p].sim.s_per_iteration:.0f}" if p in got else "")
                    for p in peers
                ],
                f"{dg.sim.s_per_iteration:.0f}",
                *[
                    _peer_cell(
                        got,
                        st,
                        p,
                        f"{dg.sim.samples_per_s / got[p].sim.samples_per_s:.2f}x" if p in got else "",
                    )
                    for p in peers
                ],
                f"{dg.speedup_vs_colocated:.2f}x",
                f"{dg.fraction_of_bound:.3f}",
                *[
                    f"{got[m].speedup_vs_colocated:.2f}x" if m in got else "-"
                    for m in [*LADDER[:-1], "colocated-digen"]
                ],
                "yes" if monotone else "NO",
            ]
        )
    return _markdown(headers, rows)


def _peer_cell(got: dict, study: Study, peer: str, text: str) -> str:
    if peer in study.no_pipeline:
        return "no such pipeline"
    if peer in study.not_modelled:
        return "not modelled"
    return text if peer in got else "-"


DATAPLANE_MODES = ("colocated", "colocated-digen", "digen")
"""The modes of the ``--all`` data-plane table: the colocated strawman, digen's own
colocated mode and digen."""


def markdown_dataplane(studies: list[tuple[str, str, Study]]) -> str:
    """The data plane per iteration of :data:`DATAPLANE_MODES`, one row per (workload,
    testbed, mode): each phase's seconds and their sum over the iteration's seconds (at most
    that share of it: the reduce and the step hold every worker up, a fetch one worker)."""
    headers = ["workload", "testbed", "mode", "s/iteration", *DATAPLANE_HEADERS, "data plane / iteration"]
    rows = []
    for workload, testbed, st in studies:
        got = {r.mode: r for r in st.results} | ({"colocated": st.colocated} if st.colocated else {})
        for mode in DATAPLANE_MODES:
            if mode in got:
                s = got[mode].sim
                share = sum(s.dataplane.values()) / s.s_per_iteration if s.s_per_iteration > 0 else 0.0
                rows.append(
                    [
                        workload,
                        testbed,
                        mode,
                        f"{s.s_per_iteration:.0f}",
                        *dataplane_cells(s),
                        f"{100 * share:.2g}%",
                    ]
                )
    return _markdown(headers, rows)


def sp_summary(choices: list[SpChoice]) -> str:
    """The sequence-parallel degree chosen per GPU type, short (the ``--all`` notes)."""
    parts = [f"{c.gpu_type} SP {c.degree} (eff {c.efficiency:.3f}, {c.efficiency_source})" for c in choices]
    return f"Sequence parallel: {'; '.join(parts)}." if parts else ""


def explain(study: Study) -> str:
    """Why digen's speedup over colocated is what it is, from the simulation: where the
    colocated GPU time goes, the ceiling any schedule has over colocated (bound /
    colocated), and digen's distance from the bound."""
    col = study.colocated
    dg = next((r for r in study.results if r.mode == "digen"), None)
    if col is None or dg is None:
        return ""
    c, d = time_shares(col.sim), time_shares(dg.sim)
    ceiling = 1 / col.fraction_of_bound if col.fraction_of_bound > 0 else float("inf")
    d_over = sum(
        d.get(k, 0.0) for k in ("weights fetch", "weights load", "trajectory fetch", "context switch", "sync")
    )
    vs_peers = ", ".join(
        f"{r.mode} {dg.sim.samples_per_s / r.sim.samples_per_s:.2f}x"
        for r in study.results
        if r.mode in PEERS and r.sim.samples_per_s > 0
    )
    missing = "".join(f"{m}: no such pipeline ({why}). " for m, why in study.no_pipeline.items())
    missing += "".join(f"{m}: not modelled ({why}). " for m, why in study.not_modelled.items())
    spent = (
        f"The colocated strawman spends {c.get('recompute', 0.0):.1%} of its GPU time recomputing old log-probs, "
        f"{c.get('offload/reload', 0.0):.1%} offloading/reloading and {c['idle']:.1%} idle (phase barriers, "
        f"unequal GPUs), "
    )
    if study.cost.fsdp_group:
        # the bound is of one FSDP trainer group; the strawman trains every GPU's own tasks
        spent += (
            f"and trains each GPU's own tasks, as replicas, which train.fsdp does not run (it needs a "
            f"disaggregated mode), so the FSDP group's bound does not bound it ({col.fraction_of_bound:.3f} of it). "
        )
    else:
        spent += (
            f"so it reaches {col.fraction_of_bound:.3f} of the bound and no schedule can beat it by more "
            f"than {ceiling:.2f}x. "
        )
    return (
        f"{study.label}: "
        + (f"digen over the peers: {vs_peers}. " if vs_peers else "")
        + missing
        + f"digen {dg.speedup_vs_colocated:.2f}x colocated, {dg.fraction_of_bound:.3f} of the bound. "
        + spent
        + f"digen idles {d['idle']:.1%} (step barrier and pipeline tails) and spends "
        f"{d_over:.1%} on weight fetches and loads, trajectory fetches and switches." + _own_colocated(study)
    )


def _own_colocated(study: Study) -> str:
    own = next((r for r in study.results if r.mode == "colocated-digen"), None)
    if own is None:
        return ""
    return (
        f" digen's own colocated mode (no offload, rollout log-probs reused) reaches {own.speedup_vs_colocated:.2f}x"
        f" ({own.fraction_of_bound:.3f} of the bound)."
    )


def plot_gantt(results: list[SimResult], out: str | Path, *, title: str = "", max_lanes: int = 24) -> int:
    """Draw the first measured iteration of each result as a Gantt panel (one lane per
    worker, bars colored by kind); returns the number of bars drawn. With more than
    ``max_lanes`` workers, evenly spaced lanes of each role are shown."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    heights = [
        min(max_lanes, len({r["worker"] for r in res.rows if r["worker"] != "controller"})) + 1
        for res in results
    ]
    fig, axes = plt.subplots(
        len(results),
        1,
        figsize=(12, 1.0 + 0.16 * sum(heights) + 0.5 * len(results)),
        dpi=100,
        squeeze=False,
        gridspec_kw={"height_ratios": heights},
    )
    bars = 0
    for ax, res in zip((a[0] for a in axes), results, strict=True):
        bars += _panel(ax, res, max_lanes)
    handles = [Patch(color=c, label=k) for k, c in KIND_COLORS.items()]
    axes[0][0].legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    axes[-1][0].set_xlabel("seconds since the iteration's start")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, format="png")
    plt.close(fig)
    return bars


def _iteration_window(res: SimResult) -> tuple[float, float]:
    """The first measured iteration's window (the job cut after it)."""
    return measured_window(res.step_ends[: res.warmup + 1], res.warmup)


def _lanes(res: SimResult, max_lanes: int) -> list[str]:
    order = {"controller": 0, "colocated": 1, "rollout": 2, "trainer": 3}
    workers: dict[str, tuple[int, str]] = {}
    for r in res.rows:
        workers.setdefault(r["worker"], (order.get(r["role"], 5), r["worker"]))
    names = [w for w, _ in sorted(workers.items(), key=lambda kv: kv[1])]
    ctl = [w for w in names if w == "controller"]
    rest = [w for w in names if w != "controller"]
    if len(rest) > max_lanes:
        step = len(rest) / max_lanes
        rest = [rest[int(i * step)] for i in range(max_lanes)]
    return ctl + rest


def _panel(ax, res: SimResult, max_lanes: int) -> int:
    lo, hi = _iteration_window(res)
    lanes = _lanes(res, max_lanes)
    lane_of = {w: i for i, w in enumerate(lanes)}
    by_kind: dict[str, list[dict]] = {}
    for r in res.rows:
        if r["worker"] in lane_of and r["end"] > lo and r["start"] < hi:
            by_kind.setdefault(r["kind"], []).append(r)
    bars = 0
    for kind, rows in by_kind.items():
        ax.barh(
            [lane_of[r["worker"]] for r in rows],
            [min(r["end"], hi) - max(r["start"], lo) for r in rows],
            left=[max(r["start"], lo) - lo for r in rows],
            height=0.8,
            color=KIND_COLORS.get(kind, OTHER_COLOR),
            edgecolor="white",
            linewidth=0.4,
        )
        bars += len(rows)
    roles = {r["worker"]: (r["role"], r["gpu_type"]) for r in res.rows}
    ax.set_yticks(
        range(len(lanes)), [f"{w} ({roles[w][0]})" if w != "controller" else w for w in lanes], fontsize=6
    )
    ax.set_ylim(len(lanes) - 0.4, -0.6)
    ax.set_xlim(0, (hi - lo) * 1.01)
    total = len({r["worker"] for r in res.rows if r["worker"] != "controller"})
    shown = f", {len(lanes) - 1} of {total} workers shown" if len(lanes) - 1 < total else ""
    ax.set_title(
        f"{res.mode}: iteration {res.warmup}, {hi - lo:.1f} s, bubble {res.bubble_ratio:.3f}{shown}",
        fontsize=9,
    )
    return bars
