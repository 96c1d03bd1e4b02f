"""Measure the on-policy PPO ratio of every mode, dtype and packing: max |ratio - 1| and the
clipped fraction of the first step of each iteration at staleness 0 (docs/precision.md).

Each cell is one ``digen train`` of the quickstart (digits) config for ``--iterations``
iterations with ``schedule.max_staleness=0``; the script reads each run's ``metrics.jsonl``
(``ratio_max_dev``, ``clipfrac``: their maximum over the iterations) and writes one Markdown
table to ``OUT/ratios.md``::

    PYTHONPATH=$PWD python scripts/on_policy_ratios.py --out runs/ratios [--iterations 2]
        [--modes digen --dtypes bfloat16 --set model.autocast=bfloat16]

At staleness 0 every iteration generates with the version it trains from, so each cell should
read 0 and 0: the trainer's recomputed log-prob equals the rollout's stored one bit for bit.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("reference", "colocated", "disaggregated", "digen")
DTYPES = ("float32", "bfloat16")


def run_cell(out: Path, mode: str, dtype: str, tsp: bool, iterations: int, extra: list[str]) -> dict:
    """One run; its worst ratio deviation and clipped fraction over the iterations."""
    run = out / f"{mode}-{dtype}-tsp{int(tsp)}"
    sets = [
        f"iterations={iterations}",
        f"schedule.mode={mode}",
        "schedule.max_staleness=0",
        f"schedule.tsp={str(tsp).lower()}",
        f"model.dtype={dtype}",
        "output.sample_grid_every=0",
        *extra,
    ]
    cmd = [
        sys.executable,
        "-m",
        "digen.cli.main",
        "train",
        str(ROOT / "configs/quickstart.yaml"),
        "--out",
        str(run),
    ]
    for s in sets:
        cmd += ["--set", s]
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, text=True)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {
        "mode": mode,
        "dtype": dtype,
        "tsp": tsp,
        "ratio_max_dev": max(r["ratio_max_dev"] for r in rows),
        "clipfrac": max(r["clipfrac"] for r in rows),
        "per_iteration": [(r["ratio_max_dev"], r["clipfrac"]) for r in rows],
    }


def table(cells: list[dict]) -> str:
    lines = [
        "| mode | dtype | TSP | max \\|ratio - 1\\| | clipped fraction |",
        "|---|---|---|---|---|",
    ]
    for c in cells:
        lines.append(
            f"| {c['mode']} | {c['dtype']} | {'on' if c['tsp'] else 'off'} | "
            f"{c['ratio_max_dev']:.3g} | {c['clipfrac']:.3g} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--set", action="append", default=[], help="extra KEY=VALUE for every run")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated schedule.mode values")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated model.dtype values")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cells = []
    for dtype in args.dtypes.split(","):
        for mode in args.modes.split(","):
            for tsp in (False, True):
                cells.append(run_cell(args.out, mode, dtype, tsp, args.iterations, args.set))
                print(json.dumps(cells[-1]), flush=True)
    (args.out / "ratios.json").write_text(json.dumps(cells, indent=1))
    (args.out / "ratios.md").write_text(table(cells))
    print(table(cells))


if __name__ == "__main__":
    main()
