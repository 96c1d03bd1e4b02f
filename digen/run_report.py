"""``digen report RUN_DIR``: one self-contained HTML page of a run.

The page holds the summary table, the timeline and reward charts, sample grids, the
held-out evaluations (``eval.jsonl``: a table of each reward's mean and std, and the grids of
``eval/``), the per-iteration metrics and the resolved config. Images are embedded as base64 PNG data URIs
and the style is inline, so the file can be mailed or attached to a CI run as is. Charts
missing from the run directory (a run still going, or ``output.plots: false``) are drawn in
memory from ``timeline.jsonl`` / ``metrics.jsonl``; the run directory is only read.
"""

from __future__ import annotations

import base64
import html
import io
import json
import time
from pathlib import Path
from typing import Any

from digen.errors import ConfigError
from digen.rundir import _read_jsonl

METRIC_COLUMNS = (
    "iteration",
    "policy_version",
    "samples",
    "reward_mean",
    "reward_std",
    "loss",
    "approx_kl",
    "clipfrac",
    "grad_norm",
    "wall_s",
    "samples_per_s",
    "bubble_ratio",
    "max_staleness",
)
STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em auto;max-width:1200px;
color:#222;padding:0 1em}
h1{font-size:1.5em}h2{font-size:1.15em;margin-top:2em;border-bottom:1px solid #ddd;padding-bottom:.2em}
table{border-collapse:collapse;font-size:.85em}td,th{border:1px solid #ddd;padding:.25em .6em;text-align:right}
th{background:#f4f4f4}td.k{text-align:left;font-weight:600}img{max-width:100%;border:1px solid #eee}
pre{background:#f8f8f8;padding:1em;overflow-x:auto;font-size:.8em}.muted{color:#777}
figure{margin:1em 0}figcaption{font-size:.85em;color:#555}
"""


def _data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def _img(png: bytes | None, alt: str, caption: str | None = None) -> str:
    if png is None:
        return f'<p class="muted">no {html.escape(alt)} (nothing recorded yet)</p>'
    cap = f"<figcaption>{html.escape(caption)}</figcaption>" if caption else ""
    return f'<figure><img alt="{html.escape(alt)}" src="{_data_uri(png)}">{cap}</figure>'


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if v is None:
        return ""
    return str(v)


def _chart(root: Path, name: str, rows: list[dict], draw) -> bytes | None:
    """The run's ``name`` PNG, or one drawn in memory from ``rows`` (None when no rows)."""
    path = root / name
    if path.exists():
        return path.read_bytes()
    if not rows:
        return None
    buf = io.BytesIO()
    draw(rows, buf)
    return buf.getvalue()


def pick_grids(paths: list[Path], limit: int) -> list[Path]:
    """At most ``limit`` grids, evenly spread, always the first and the last."""
    paths = sorted(paths)
    if len(paths) <= limit:
        return paths
    if limit <= 1:
        return paths[-1:]
    idx = sorted({round(i * (len(paths) - 1) / (limit - 1)) for i in range(limit)})
    return [paths[i] for i in idx]


def _summary_table(summary: dict[str, Any]) -> str:
    cells = "".join(
        f'<tr><td class="k">{html.escape(k)}</td><td>{html.escape(_fmt(v))}</td></tr>'
        for k, v in summary.items()
    )
    return f"<table>{cells}</table>"


def _metrics_table(rows: list[dict]) -> str:
    cols = [c for c in METRIC_COLUMNS if any(c in r for r in rows)]
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_fmt(r.get(c)))}</td>" for c in cols) + "</tr>" for r in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _eval_table(rows: list[dict]) -> str:
    """One row per evaluation: iteration, version, prompts, ``mean ± std`` of each reward."""
    names = [k[: -len("_mean")] for k in rows[0] if k.endswith("_mean")]
    head = "".join(
        f"<th>{html.escape(c)}</th>" for c in ["iteration", "policy_version", "num_prompts", *names]
    )
    body = ""
    for r in rows:
        cells = [_fmt(r.get("iteration")), _fmt(r.get("policy_version")), _fmt(r.get("num_prompts"))]
        cells += [f"{_fmt(r.get(n + '_mean'))} ± {_fmt(r.get(n + '_std'))}" for n in names]
        body += "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>"
    return f"<table><tr>{head}</tr>{body}</table>"


def _eval_section(root: Path, max_grids: int) -> list[str]:
    rows = _read_jsonl(root / "eval.jsonl")
    if not rows:
        return []
    grids = pick_grids(list((root / "eval").glob("iter_*.png")), max(1, max_grids // 2))
    return [
        "<h2>Held-out evaluation</h2>",
        '<p class="muted">ODE sampler, fixed seeds, one sample per test prompt; '
        "<code>reward</code> is the weighted sum of the rewards</p>",
        _eval_table(rows),
        *[_img(p.read_bytes(), p.name, "eval " + p.stem.replace("_", " ")) for p in grids],
    ]


def render_report(run_dir: str | Path, *, max_grids: int = 8) -> str:
    """The HTML page of ``run_dir`` as a string."""
    from digen.plots import plot_rewards, plot_timeline

    root = Path(run_dir)
    if not (root / "config.yaml").exists() and not (root / "metrics.jsonl").exists():
        raise ConfigError(
            f"{root} is not a digen run directory (no config.yaml or metrics.jsonl); "
            f"pass the --out folder of `digen train`"
        )
    metrics = _read_jsonl(root / "metrics.jsonl")
    timeline = _read_jsonl(root / "timeline.jsonl")
    summary_path = root / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    config = (root / "config.yaml").read_text() if (root / "config.yaml").exists() else ""
    mode = (summary or {}).get("mode") or next(
        (ln.split(":", 1)[1].strip() for ln in config.splitlines() if ln.strip().startswith("mode:")), "?"
    )

    parts = [
        f"<h1>digen run <code>{html.escape(root.resolve().name)}</code> · {html.escape(mode)}</h1>",
        f'<p class="muted">{html.escape(str(root.resolve()))} · report written '
        f"{time.strftime('%Y-%m-%d %H:%M:%S')}</p>",
        "<h2>Summary</h2>",
    ]
    if summary is not None:
        parts.append(_summary_table(summary))
    else:
        parts.append(
            f'<p class="muted">no summary.json yet (run not finished); '
            f"{len(metrics)} iteration(s) recorded</p>"
        )
    parts += [
        "<h2>Timeline</h2>",
        _img(
            _chart(root, "timeline.png", timeline, plot_timeline),
            "timeline",
            "one lane per worker; bars colored by task kind, hatched = stale rollout",
        ),
        "<h2>Rewards and KL</h2>",
        _img(_chart(root, "rewards.png", metrics, plot_rewards), "reward curves"),
    ]
    grids = pick_grids(list((root / "samples").glob("iter_*.png")), max_grids)
    parts.append("<h2>Samples</h2>")
    if grids:
        parts += [_img(p.read_bytes(), p.name, p.stem.replace("_", " ")) for p in grids]
    else:
        parts.append('<p class="muted">no sample grids (output.sample_grid_every: 0?)</p>')
    parts += _eval_section(root, max_grids)
    parts += [
        "<h2>Iterations</h2>",
        _metrics_table(metrics) if metrics else '<p class="muted">none</p>',
        "<h2>Config</h2>",
        f"<pre>{html.escape(config)}</pre>",
    ]
    return (
        "<!DOCTYPE html>\n<html><head><meta charset='utf-8'>"
        f"<title>digen report: {html.escape(root.resolve().name)}</title><style>{STYLE}</style></head>"
        "<body>" + "\n".join(parts) + "</body></html>\n"
    )


def write_report(run_dir: str | Path, out: str | Path | None = None, *, max_grids: int = 8) -> Path:
    """Write the report of ``run_dir`` to ``out`` (default ``RUN_DIR/report.html``)."""
    target = Path(out) if out is not None else Path(run_dir) / "report.html"
    page = render_report(run_dir, max_grids=max_grids)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(page)
    return target
