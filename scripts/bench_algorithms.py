"""Bench the training algorithms side by side on the digits workload with ``digen bench``,
over several seeds, in one mode held fixed.

Each algorithm is one ``digen bench`` of the same workload (the digits demo's four hardest
digits, 16 samples each, as tests/trainer/test_algorithms_learn.py) per seed (the config's
top-level ``seed``: 0, 1, ... ``--seeds`` - 1), every algorithm in the same ``--mode`` (all of
them run in ``reference`` and ``digen``), so that the algorithm is the only thing that differs
between rows. The script reads each bench's ``bench.json`` (samples/s: median over the
iterations after warm-up) and the run's ``metrics.jsonl`` (reward gain: the mean reward of the
last 3 iterations minus that of the first 3), and writes per algorithm the mean over seeds of
both with a 95% confidence interval (Student t, n - 1 degrees of freedom), plus one sentence
for each pair whose intervals do not overlap (and nothing for those that do)::

    PYTHONPATH=$PWD python scripts/bench_algorithms.py --out runs/bench-algorithms \\
        --mode reference --seeds 3 [--iterations 30]

The table goes to ``OUT/algorithms-MODE.md`` (docs/algorithms.md quotes one) and every
finished run to ``OUT/algorithms-MODE.json`` as it completes, so a stopped bench still reports
the seeds it finished (``--render`` rewrites the table from that file without running
anything; each row states its n). Seeds are the outer loop, so load on a shared machine spreads
over every algorithm alike.
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
MODES = ("reference", "digen")  # the modes every algorithm below runs in
ALGORITHMS: dict[str, tuple[str, list[str]]] = {
    # name: (config, overrides)
    "flow-grpo": ("configs/quickstart.yaml", []),
    "flow-grpo-fast": (
        "configs/quickstart.yaml",
        ["train.timesteps.strategy=window", "train.timesteps.window=3"],
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
    ),
    "mix-grpo": ("configs/examples/digits-mix-grpo.yaml", []),
    "mix-grpo (flash)": (
        "configs/examples/digits-mix-grpo.yaml",
        ["train.mix_grpo.flash=true", "train.mix_grpo.flash_compress=0.5"],
    ),
    "grpo-guard": ("configs/quickstart.yaml", ["train.algorithm=grpo-guard", "train.clip_range=2e-3"]),
    "flow-dppo": (
        "configs/quickstart.yaml",
        ["train.algorithm=flow-dppo", "train.flow_dppo.kl_threshold=1e-3"],
    ),
    "flow-grpo no-CFG + velocity KL": (
        "configs/quickstart.yaml",
        ["train.kl_beta=2e-3", "train.kl_target=velocity"],
    ),
    "flow-grpo, 2 mini-batches": ("configs/quickstart.yaml", ["train.mini_batches=2", "train.lr=3.5e-3"]),
    "diffusion-nft": ("configs/examples/digits-diffusion-nft.yaml", []),
    # the clean-sample family beyond DiffusionNFT, at their own defaults (rollout CFG as the demo)
    "dgpo": ("configs/quickstart.yaml", ["train.algorithm=dgpo"]),
    "awm": ("configs/quickstart.yaml", ["train.algorithm=awm"]),
    "online-dpo": ("configs/quickstart.yaml", ["train.algorithm=online-dpo"]),
}

# Two-sided 95% quantiles of Student's t, t_{0.975, dof}, for dof 1..30 (standard tables; scipy
# is not a dependency). Beyond 30 the value for 30 is used: slightly wider than exact, never
# narrower.
T95 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def t95(dof: int) -> float:
    """The two-sided 95% Student t quantile for ``dof`` >= 1 degrees of freedom."""
    if dof < 1:
        raise ValueError(f"t quantile needs at least 1 degree of freedom, got {dof}")
    return T95[min(dof, len(T95)) - 1]


def mean_ci(xs: list[float]) -> tuple[float, float]:
    """Mean of ``xs`` and the half-width of its 95% confidence interval (Student t, n - 1
    degrees of freedom, sample standard deviation); the half-width is NaN for a single value."""
    n = len(xs)
    if n == 0:
        raise ValueError("mean_ci of no values")
    mean = sum(xs) / n
    if n == 1:
        return mean, math.nan
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    return mean, t95(n - 1) * sd / math.sqrt(n)


def separated(a: tuple[float, float], b: tuple[float, float]) -> int:
    """+1 if interval ``a`` (mean, half-width) lies wholly above ``b``, -1 if wholly below,
    0 if they overlap or either has no width (n = 1)."""
    (ma, ha), (mb, hb) = a, b
    if math.isnan(ha) or math.isnan(hb):
        return 0
    if ma - ha > mb + hb:
        return 1
    if ma + ha < mb - hb:
        return -1
    return 0


def summarize(runs: list[dict]) -> list[dict]:
    """One row per algorithm (first-seen order): n, and the mean and 95% half-width of the
    reward gain, samples/s, and the first and last 3 iterations' reward, over its runs."""
    names = list(dict.fromkeys(r["algorithm"] for r in runs))
    rows = []
    for name in names:
        mine = [r for r in runs if r["algorithm"] == name]
        row = {"algorithm": name, "n": len(mine), "seeds": sorted(r["seed"] for r in mine)}
        for key in ("gain", "samples_per_s", "first", "last"):
            row[key] = mean_ci([float(r[key]) for r in mine])
        rows.append(row)
    return rows


def verdicts(rows: list[dict]) -> list[str]:
    """Sentences the intervals support: a gain whose interval excludes 0, and each pair of
    algorithms whose gain or samples/s intervals do not overlap. Nothing for the rest."""
    out = []
    for r in rows:
        m, h = r["gain"]
        if not math.isnan(h) and m - h > 0:
            out.append(f"{r['algorithm']} gained reward (gain {m:+.3f} ± {h:.3f}, n={r['n']}).")
        elif not math.isnan(h) and m + h < 0:
            out.append(f"{r['algorithm']} lost reward (gain {m:+.3f} ± {h:.3f}, n={r['n']}).")
    for key, what in (("gain", "a larger reward gain"), ("samples_per_s", "more samples/s")):
        for i, a in enumerate(rows):
            for b in rows[i + 1 :]:
                s = separated(a[key], b[key])
                if s:
                    hi, lo = (a, b) if s > 0 else (b, a)
                    out.append(f"{hi['algorithm']} had {what} than {lo['algorithm']}.")
    return out


def table(rows: list[dict]) -> list[str]:
    """The Markdown table of :func:`summarize`'s rows (mean ± 95% half-width; n = 1: no interval)."""

    def pm(v: tuple[float, float], fmt: str) -> str:
        m, h = v
        return format(m, fmt) + ("" if math.isnan(h) else " ± " + format(h, fmt.lstrip("+")))

    lines = [
        "| algorithm | n (seeds) | reward gain, last 3 - first 3 (95% CI) | samples/s (95% CI) "
        "| reward first 3 -> last 3 (means) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        seeds = ",".join(str(s) for s in r["seeds"])
        lines.append(
            f"| {r['algorithm']} | {r['n']} ({seeds}) | {pm(r['gain'], '+.3f')} | {pm(r['samples_per_s'], '.1f')} "
            f"| {r['first'][0]:.3f} -> {r['last'][0]:.3f} |"
        )
    return lines


def reward_windows(run: Path, k: int = 3) -> dict:
    """Mean reward of the run's first and last ``k`` iterations, their difference, wall seconds."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

    def mean(rs: list[dict]) -> float:
        xs = [x for r in rs for x in r["rewards"]]
        return sum(xs) / len(xs)

    first, last = mean(rows[:k]), mean(rows[-k:])
    wall, samples, curve = 0.0, 0, []
    for r in rows:  # the reward reached against cumulative wall seconds and generated samples
        wall += float(r["wall_s"])
        samples += int(r["samples"]) + int(r.get("dropped_samples", 0))
        curve.append([wall, samples, float(r["reward_mean"])])
    return {"first": first, "last": last, "gain": last - first, "wall_s": wall, "curve": curve}


def bench(name: str, seed: int, mode: str, out: Path, iterations: int) -> dict:
    """One ``digen bench`` of ``name`` at ``seed`` in ``mode``; its row."""
    config, overrides = ALGORITHMS[name]
    slug = name.replace(" ", "_").replace(",", "").replace("(", "").replace(")", "")
    folder = out / mode / f"seed{seed}" / slug
    sets = [f"seed={seed}", f"iterations={iterations}", *WORKLOAD, *overrides]
    cmd = [sys.executable, "-m", "digen.cli.main", "bench", config, "--modes", mode, "--rounds", "1"]
    cmd += ["--warmup", "1", "--tsp-k", "none", "--out", str(folder)]
    for s in sets:
        cmd += ["--set", s]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    (row,) = json.loads((folder / "bench.json").read_text())  # one mode, one round: one row
    rw = reward_windows(Path(row["run_dirs"][0]))
    return {"algorithm": name, "seed": seed, "mode": mode, "samples_per_s": row["samples_per_s"], **rw}


def reached(curve: list[list[float]], axis: int, budget: float, k: int = 3) -> float:
    """The mean reward of the last ``k`` iterations finished within ``budget`` on ``axis`` (0:
    cumulative wall seconds, 1: generated samples); NaN when fewer than ``k`` finished."""
    done = [c[2] for c in curve if c[axis] <= budget]
    return sum(done[-k:]) / k if len(done) >= k else math.nan


def mean_se(xs: list[float]) -> str:
    """``mean ± standard error`` of the finite ``xs`` (``n/a`` for none, the mean alone for one)."""
    xs = [x for x in xs if not math.isnan(x)]
    if not xs:
        return "n/a"
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return f"{m:.3g}"
    se = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))
    return f"{m:.3g} ± {se:.2g}"


def time_to(curve: list[list[float]], target: float, k: int = 3) -> tuple[float, float]:
    """(wall seconds, generated samples) when the mean reward of the last ``k`` iterations
    first reaches ``target``; NaNs when it never does."""
    for i in range(k - 1, len(curve)):
        if sum(c[2] for c in curve[i - k + 1 : i + 1]) / k >= target:
            return curve[i][0], curve[i][1]
    return math.nan, math.nan


def reward_reached_table(runs: list[dict], targets: tuple[float, ...] = (0.5, 0.55)) -> list[str]:
    """Per algorithm, mean ± standard error over seeds: the reward reached at half and all of
    the generated samples every run made, and the samples and wall seconds until the trailing
    3-iteration mean reward first reaches each target (k/n: how many seeds reached it)."""
    runs = [r for r in runs if "curve" in r]
    if not runs:
        return []
    budgets = [min(r["curve"][-1][1] for r in runs) * f for f in (0.5, 1.0)]
    head = [f"reward at {int(b)} samples" for b in budgets]
    for t in targets:
        head += [f"samples to {t}", f"seconds to {t}"]
    lines = ["| algorithm | n | " + " | ".join(head) + " |", "|---|---|" + "---|" * len(head)]
    for name in dict.fromkeys(r["algorithm"] for r in runs):
        mine = [r for r in runs if r["algorithm"] == name]
        cells = [mean_se([reached(r["curve"], 1, b) for r in mine]) for b in budgets]
        for t in targets:
            hits = [time_to(r["curve"], t) for r in mine]
            k = sum(1 for h in hits if not math.isnan(h[1]))
            cells += [f"{mean_se([h[1] for h in hits])} ({k}/{len(mine)})", mean_se([h[0] for h in hits])]
        lines.append(f"| {name} | {len(mine)} | " + " | ".join(cells) + " |")
    return lines


def plot(runs: list[dict], out: Path, mode: str) -> None:
    """OUT/algorithms-MODE.png: mean reward over seeds against generated samples and wall seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in runs if "curve" in r]
    if not runs:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name in dict.fromkeys(r["algorithm"] for r in runs):
        mine = [r["curve"] for r in runs if r["algorithm"] == name]
        n = min(len(c) for c in mine)
        reward = [sum(c[i][2] for c in mine) / len(mine) for i in range(n)]
        for ax, axis in zip(axes, (1, 0), strict=True):
            ax.plot([sum(c[i][axis] for c in mine) / len(mine) for i in range(n)], reward, label=name)
    axes[0].set_xlabel("generated samples")
    axes[1].set_xlabel("wall seconds")
    for ax in axes:
        ax.set_ylabel("reward (mean over seeds)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / f"algorithms-{mode}.png", dpi=110)


def render(runs: list[dict], out: Path, mode: str) -> str:
    """Write OUT/algorithms-MODE.md (table, then verdicts, then the reward reached within sample
    and wall-second budgets) and OUT/algorithms-MODE.png, and return the text."""
    rows = summarize(runs)
    said = verdicts(rows)
    text = "\n".join(table(rows)) + "\n\n" + "\n".join(f"- {s}" for s in said or ["(no interval separates)"])
    reach = reward_reached_table(runs)
    if reach:
        text += "\n\n" + "\n".join(reach)
    plot(runs, out, mode)
    (out / f"algorithms-{mode}.md").write_text(text + "\n")
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("runs/bench-algorithms"))
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--seeds", type=int, default=3, help="seeds 0 .. N-1 per algorithm (default 3)")
    ap.add_argument("--mode", choices=MODES, default="reference", help="the one mode every algorithm runs in")
    ap.add_argument("--only", nargs="*", choices=list(ALGORITHMS), help="algorithm names (default: all)")
    ap.add_argument(
        "--render", action="store_true", help="only rewrite the table from OUT/algorithms-MODE.json"
    )
    args = ap.parse_args()
    if args.seeds < 1 or args.iterations < 7:
        ap.error("--seeds must be at least 1 and --iterations at least 7 (two windows of 3 after warm-up)")
    args.out.mkdir(parents=True, exist_ok=True)
    saved = args.out / f"algorithms-{args.mode}.json"
    runs = json.loads(saved.read_text()) if saved.exists() else []
    if not args.render:
        runs = []
        for seed in range(args.seeds):
            for name in args.only or ALGORITHMS:
                print(f"bench {name} seed {seed} ({args.mode})", file=sys.stderr, flush=True)
                runs.append(bench(name, seed, args.mode, args.out, args.iterations))
                saved.write_text(json.dumps(runs, indent=1))
    print(render(runs, args.out, args.mode))


if __name__ == "__main__":
    main()
