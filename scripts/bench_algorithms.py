"""Bench the training algorithms side by side on the digits workload with ``digen bench``.

Each algorithm is one ``digen bench`` of the same workload (the digits demo's four hardest
digits, 16 samples each, as tests/trainer/test_algorithms_learn.py) in the modes it runs in
now; this script reads each bench's ``bench.json`` (samples/s: median over the iterations
after warm-up) and the runs' ``metrics.jsonl`` (reward of the first and last 3 iterations,
wall seconds), and writes one Markdown table::

    PYTHONPATH=$PWD python scripts/bench_algorithms.py --out runs/bench-algorithms [--iterations 30]

The table goes to ``OUT/algorithms.md`` (docs/algorithms.md quotes one). Runs one after the
other: on a shared machine compare rows measured close together.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKLOAD = [
    "rollout.batch_size=64",
    "rollout.group_size=16",
    "prompts.file=null",
    'prompts.items=["a handwritten 3", "a handwritten 7", "a handwritten 8", "a handwritten 9"]',
    "output.sample_grid_every=0",
    "output.plots=false",
    "train.lr=5e-3",
    "train.clip_range=1e-2",
]
ALGORITHMS: dict[str, tuple[str, list[str], str]] = {
    # name: (config, overrides, modes)
    "flow-grpo": ("configs/quickstart.yaml", [], "reference,digen"),
    "flow-grpo-fast": (
        "configs/quickstart.yaml",
        ["train.timesteps.strategy=window", "train.timesteps.window=3"],
        "reference,digen",
    ),
    "dance-grpo": (
        "configs/quickstart.yaml",
        [
            "rollout.sde.kind=dance",
            "rollout.sde.noise_level=0.3",
            "rollout.shared_noise=true",
            "train.timesteps.strategy=random",
            "train.timesteps.fraction=0.6",
            "train.unbiased_std=true",
        ],
        "reference,digen",
    ),
    "mix-grpo": ("configs/examples/digits-mix-grpo.yaml", [], "reference,digen"),
    "mix-grpo (flash)": (
        "configs/examples/digits-mix-grpo.yaml",
        ["train.mix_grpo.flash=true", "train.mix_grpo.flash_compress=0.5"],
        "reference,digen",
    ),
    "grpo-guard": (
        "configs/quickstart.yaml",
        ["train.algorithm=grpo-guard", "train.clip_range=2e-3"],
        "reference,digen",
    ),
    "flow-dppo": (
        "configs/quickstart.yaml",
        ["train.algorithm=flow-dppo", "train.flow_dppo.kl_threshold=1e-3"],
        "reference,digen",
    ),
    "flow-grpo no-CFG + velocity KL": (
        "configs/quickstart.yaml",
        ["train.kl_beta=2e-3", "train.kl_target=velocity"],
        "reference,digen",
    ),
    "flow-grpo, 2 mini-batches": (
        "configs/quickstart.yaml",
        ["train.mini_batches=2", "train.lr=3.5e-3"],
        "reference,digen",
    ),
    "diffusion-nft": ("configs/examples/digits-diffusion-nft.yaml", [], "reference,digen"),
}


def reward_windows(run: Path, k: int = 3) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

    def stats(rs: list[dict]) -> tuple[float, float, int]:
        xs = [x for r in rs for x in r["rewards"]]
        mean = sum(xs) / len(xs)
        var = sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)
        return mean, var, len(xs)

    (m0, v0, n0), (m1, v1, n1) = stats(rows[:k]), stats(rows[-k:])
    wall = sum(float(r["wall_s"]) for r in rows)
    return {
        "first": m0,
        "last": m1,
        "z": (m1 - m0) / math.sqrt(v0 / n0 + v1 / n1),
        "wall_s": wall,
        "gain_per_min": 60 * (m1 - m0) / wall,
    }


def bench(name: str, config: str, overrides: list[str], modes: str, out: Path, iterations: int) -> list[dict]:
    folder = out / name.replace(" ", "_").replace(",", "").replace("(", "").replace(")", "")
    sets = [f"iterations={iterations}", *WORKLOAD, *overrides]
    cmd = [sys.executable, "-m", "cli.main", "bench", config, "--modes", modes, "--rounds", "1"]
    cmd += ["--warmup", "1", "--tsp-k", "none", "--out", str(folder)]
    for s in sets:
        cmd += ["--set", s]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    rows = json.loads((folder / "bench.json").read_text())  # one row per mode
    out_rows = []
    for r in rows:
        rw = reward_windows(Path(r["run_dirs"][0]))
        out_rows.append({"algorithm": name, "mode": r["mode"], "samples_per_s": r["samples_per_s"], **rw})
    return out_rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("runs/bench-algorithms"))
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--only", nargs="*", help="algorithm names (default: all)")
    ap.add_argument(
        "--append", action="store_true", help="add to OUT/algorithms.json instead of replacing it"
    )
    args = ap.parse_args()
    saved = args.out / "algorithms.json"
    rows = json.loads(saved.read_text()) if args.append and saved.exists() else []
    for name, (config, overrides, modes) in ALGORITHMS.items():
        if args.only and name not in args.only:
            continue
        print(f"bench {name} ({modes})", file=sys.stderr, flush=True)
        rows += bench(name, config, overrides, modes, args.out, args.iterations)
    lines = [
        "| algorithm | mode | samples/s | reward first 3 -> last 3 | gap (std. errors) | reward gain per wall-minute |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['algorithm']} | {r['mode']} | {r['samples_per_s']:.1f} | {r['first']:.3f} -> {r['last']:.3f} "
            f"| {r['z']:.1f} | {r['gain_per_min']:+.3f} |"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "algorithms.json").write_text(json.dumps(rows, indent=1))
    (args.out / "algorithms.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
