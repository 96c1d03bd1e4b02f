"""digen CLI commands: bench and report (registered on digen.cli.app.app)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Annotated

import typer

from digen.cli.app import SetOpt, app, err, handles_errors, out
from digen.cli.console import open_run_log, setup_logging
from digen.cli.progress import Steps
from digen.errors import ConfigError

DEFAULT_MODES = "reference,colocated,disaggregated,digen"


def _ks(text: str, option: str = "--tsp-k") -> list[int]:
    if text.strip().lower() in ("", "none", "off"):
        return []
    try:
        ks = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(
            f"{option} ({text}) must be comma-separated integers, e.g. 1,2,4,8, or none"
        ) from None
    if any(k < 1 for k in ks):
        raise ConfigError(f"{option} ({text}): every value must be at least 1")
    return ks


def _command(
    config: Path,
    modes: str,
    workers: str | None,
    out_dir: Path,
    rounds: int,
    warmup: int,
    sets: list[str],
    tsp_k: str,
    batch_sizes: str = "none",
) -> str:
    """The command line that reproduces this bench (for the Markdown header)."""
    args = [
        "digen",
        "bench",
        str(config),
        "--modes",
        modes,
        "--rounds",
        str(rounds),
        "--warmup",
        str(warmup),
        "--out",
        str(out_dir),
    ]
    if workers:
        args += ["--workers", workers]
    if tsp_k != "1,2,4,8":
        args += ["--tsp-k", tsp_k]
    if batch_sizes != "1,2,4,8":
        args += ["--batch-sizes", batch_sizes]
    for s in sets:
        args += ["--set", s]
    return shlex.join(args)


@app.command()
@handles_errors
def bench(
    config: Annotated[Path, typer.Argument(help="YAML config of the workload.")] = Path(
        "configs/quickstart.yaml"
    ),
    modes: Annotated[
        str,
        typer.Option(
            "--modes",
            help="Comma-separated modes; ablations as digen-tag, digen-tsp, digen-gap, digen-async; "
            "digen+eval / digen-eval: held-out evaluation on / off.",
        ),
    ] = DEFAULT_MODES,
    workers: Annotated[
        str | None,
        typer.Option(
            "--workers",
            help="ROLLOUT,TRAINER worker counts (colocated uses their sum); default: the config's.",
        ),
    ] = None,
    out_dir: Annotated[
        Path, typer.Option("--out", help="Output folder (bench.json, bench.md, runs/).")
    ] = Path("runs/bench"),
    rounds: Annotated[int, typer.Option("--rounds", help="Interleaved repetitions of every mode.")] = 2,
    warmup: Annotated[
        int,
        typer.Option(
            "--warmup", help="Iterations left out of the medians (the first includes model loading)."
        ),
    ] = 1,
    set_: SetOpt = None,
    tsp_k: Annotated[
        str, typer.Option("--tsp-k", help="K values of the TSP micro-benchmark, or none.")
    ] = "1,2,4,8",
    batch_sizes: Annotated[
        str,
        typer.Option(
            "--batch-sizes",
            help="rollout.max_batch values of the generation-batching micro-benchmark, or none "
            "(the modes run with the config's rollout.max_batch: --set rollout.max_batch=4).",
        ),
    ] = "1,2,4,8",
    as_json: Annotated[bool, typer.Option("--json", help="Print bench.json instead of the table.")] = False,
    dataplane: Annotated[
        bool,
        typer.Option(
            "--dataplane",
            help="Benchmark the data plane instead (gradient reduction, optimizer step, weight "
            "distribution, a trajectory) at the sizes of --sizes, beside the path through Redis "
            "it replaced; writes bench-dataplane.json and .md. Ignores CONFIG and the mode options.",
        ),
    ] = False,
    sizes: Annotated[
        str,
        typer.Option(
            "--sizes", help="With --dataplane: comma-separated sizes (digen.bench.dataplane.SIZES)."
        ),
    ] = "sd3.5-m-lora-r32,flux-lora-r64,qwen-image-lora-r64,full-4gib",
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Run the same workload in each mode side by side (interleaved, repeated, medians);
    write bench.json and a Markdown table (bench.md). With --dataplane, benchmark the data
    plane at real model sizes instead."""
    from digen.bench import parse_modes, parse_workers, run_bench, write_outputs
    from digen.config import load_config

    setup_logging(verbose, out_dir / "digen.log", dask=True)  # Dask logs every cluster start and stop
    open_run_log()  # the bench writes its own folder
    if dataplane:
        _dataplane(sizes, out_dir, as_json)
        return
    mode_list = parse_modes(modes)
    counts = parse_workers(workers)
    ks = _ks(tsp_k)
    batches = _ks(batch_sizes, "--batch-sizes")
    cfg = load_config(config, set_ or [])
    if cfg.cluster.local.start_method == "forkserver" and any(m != "reference" for m in mode_list):
        from digen.cluster.cluster import prefork_server

        prefork_server()  # before the reference run computes anything (see its docstring)
    with Steps("bench", rounds * len(mode_list) + (1 if ks else 0) + (1 if batches else 0)) as steps:
        result = run_bench(
            cfg,
            mode_list,
            out_dir,
            rounds=rounds,
            warmup=warmup,
            workers=counts,
            tsp_ks=ks,
            batch_sizes=batches,
            notify=lambda msg: err.print(f"  {msg}", style="dim", highlight=False, markup=False),
            started=steps.start,
        )
    command = _command(config, modes, workers, out_dir, rounds, warmup, set_ or [], tsp_k, batch_sizes)
    paths = write_outputs(result, out_dir, command=command, rounds=rounds, warmup=warmup)
    if as_json:
        print(json.dumps(result.rows, indent=1), flush=True)
    else:
        out.print(paths["markdown"].read_text(), highlight=False, markup=False, soft_wrap=True)
        err.print(f"wrote {paths['json']} and {paths['markdown']}", highlight=False)


def _dataplane(sizes: str, out_dir: Path, as_json: bool) -> None:
    import datetime
    import subprocess

    from digen.bench.dataplane import SIZES, run_dataplane_bench, write_dataplane_report

    names = [x.strip() for x in sizes.split(",") if x.strip()]
    unknown = [n for n in names if n not in SIZES]
    if unknown or not names:
        raise ConfigError(
            f"--sizes ({sizes}): {', '.join(unknown) or 'none given'}; choose from {', '.join(SIZES)}"
        )
    rounds = run_dataplane_bench(
        {n: SIZES[n] for n in names}, progress=lambda msg: err.print(f"[dim]{msg}[/dim]", highlight=False)
    )
    commit = (
        subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
        or "unknown"
    )
    command = shlex.join(["digen", "bench", "--dataplane", "--sizes", ",".join(names), "--out", str(out_dir)])
    date = datetime.date.today().isoformat()
    path_json, path_md = write_dataplane_report(rounds, out_dir, command, commit, date)
    if as_json:
        print(path_json.read_text(), flush=True)
    else:
        out.print(path_md.read_text(), highlight=False, markup=False, soft_wrap=True)
        err.print(f"wrote {path_json} and {path_md}", highlight=False)


@app.command()
@handles_errors
def report(
    run_dir: Annotated[Path, typer.Argument(help="Run directory (the --out of digen train).")],
    out_file: Annotated[
        Path | None, typer.Option("--out", help="HTML file (default RUN_DIR/report.html).")
    ] = None,
    max_grids: Annotated[int, typer.Option("--max-grids", help="Sample grids shown at most.")] = 8,
) -> None:
    """Write a self-contained HTML page of a run: config, summary, timeline, curves, grids."""
    from digen.run_report import write_report

    if not run_dir.is_dir():
        raise ConfigError(f"RUN_DIR ({run_dir}) is not a folder; pass the --out folder of `digen train`")
    path = write_report(run_dir, out_file, max_grids=max_grids)
    out.print(f"wrote {path}", highlight=False)
