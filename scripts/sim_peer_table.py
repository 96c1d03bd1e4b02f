"""The rows of docs/benchmarks.md's simulator table: every peer mode and ``digen`` on each
config of ``configs/sim`` (or the configs named), each at its own ``sim:`` window, the split
search at ``neighbours`` 1 (the configs say 2; 1 keeps the run to about half a minute a
config on a loaded 2-core machine, and digen's rows were within 1% of the neighbours-2 run).

    python scripts/sim_peer_table.py [CONFIG_STEM ...] [--neighbours N]

Prints one Markdown row per config, in the table's column order; the best peer is the peer
mode with the most samples per second among those with a pipeline for the model.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

from digen.sim.catalog import is_run_config, load_sim_config
from digen.sim.driver import PEERS
from digen.sim.study import run_study

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "sim"
COMMITS = {
    "verl-omni-unbatched": "2026-04",
    "verl-omni": "a1139ba",
    "verl-omni-async": "a1139baf",
    "unirl-async": "37ea9f27",
    "genrl": "82a867e",
    "flow-grpo": "6cf00e0",
}
"""The commit each peer mode is restated from, as the table's column headers name it."""


def row(path: Path, neighbours: int) -> str:
    setup = load_sim_config(path)
    st = run_study(setup.cost, [*PEERS, "digen"], replace(setup.settings, neighbours=neighbours))
    got = {r.mode: r for r in st.results}
    sps = {m: r.sim.samples_per_s for m, r in got.items()}
    dg = got["digen"]

    def cell(peer: str, text: str) -> str:
        if peer in st.no_pipeline:
            return "no such pipeline"
        if peer in st.not_modelled:
            return "not modelled"
        return text

    peers = [p for p in PEERS if p in got]
    best = max(peers, key=lambda p: sps[p]) if peers else None
    if best is None:
        name, ahead = "none (no peer has a pipeline)", "-"
    else:
        ratio = sps["digen"] / sps[best]
        name, ahead = f"{best} ({COMMITS[best]})", f"{'yes' if ratio > 1 else 'no'}, {ratio:.2f}x"
    cells = [
        setup.workload.name,
        setup.testbed.name,
        str(setup.cost.gpu_count),
        *[cell(p, f"{got[p].sim.s_per_iteration:.0f}" if p in got else "-") for p in PEERS],
        f"{dg.sim.s_per_iteration:.0f}",
        f"{dg.fraction_of_bound:.3f}",
        *[cell(p, f"{sps['digen'] / sps[p]:.2f}x" if p in got else "-") for p in PEERS],
        name,
        ahead,
    ]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs", nargs="*", help="config stems (default: every run config of configs/sim)")
    ap.add_argument("--neighbours", type=int, default=1)
    args = ap.parse_args()
    files = sorted(p for p in CONFIGS.glob("*.yaml") if is_run_config(p))
    if args.configs:
        files = [p for p in files if p.stem in args.configs]
    for p in files:
        t0 = time.monotonic()
        print(row(p, args.neighbours), flush=True)
        print(f"<!-- {p.stem}: {time.monotonic() - t0:.0f} s -->", flush=True)


if __name__ == "__main__":
    main()
