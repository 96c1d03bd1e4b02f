"""``digen plan`` (which GPU each worker of a config gets, nothing started) and ``digen doctor``
(this machine's environment in one table, and on request a short GPU benchmark)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from digen.cli.app import ConfigArg, SetOpt, app, err, handles_errors, out


@app.command()
@handles_errors
def plan(
    config: ConfigArg,
    gpus: Annotated[
        str | None,
        typer.Option(
            "--gpus", help="Plan for another machine: 8xh100, 4xh100,4xl40s (default: this one's GPUs)."
        ),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="A JSON list of {worker, role, gpus, gpu_type}.")
    ] = False,
    set_: SetOpt = None,
) -> None:
    """Print the embedded cluster's placement: which GPU each worker of CONFIG gets (exit 2 when they do not fit)."""
    from digen.cluster.placement import discover, parse_spec, plan_local
    from digen.config import load_config

    cfg = load_config(config, set_ or [], check_paths=False, algorithms=False)
    machine = parse_spec(gpus) if gpus is not None else discover()
    placement = plan_local(cfg, machine)
    lines = memory_lines(cfg, placement, machine)
    if as_json:
        print(json.dumps(placement.to_json()), flush=True)
        return
    out.print("\n".join(placement.lines() + lines), highlight=False, markup=False)


def memory_lines(cfg, placement, machine) -> list[str]:
    """Each worker's predicted peak memory (:mod:`digen.memory`), or why there is none; a
    :class:`~digen.errors.ConfigError` when a GPU's workers do not fit it."""
    from digen.errors import ConfigError
    from digen.memory import fit_problem, predict

    model = cfg.resolve_path(cfg.model.path)
    if not (model / "model_index.json").exists():
        return [f"memory: not predicted (no pipeline at model.path {model})"]
    estimates = predict(cfg)
    problem = None if placement.cpu_reason is not None else fit_problem(estimates, placement, machine)
    if problem is not None:
        raise ConfigError(problem)
    return ["memory (predicted peak per worker):"] + [e.line() for e in estimates]


@app.command()
@handles_errors
def doctor(
    config: Annotated[
        Path | None,
        typer.Argument(help="Config whose placement to show (default configs/quickstart.yaml when present)."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="The report as one JSON object.")] = False,
    gpu_bench: Annotated[
        bool,
        typer.Option(
            "--gpu-bench",
            help="Also measure the GPUs (NCCL all-reduce, a 684 MiB weight fetch, a bf16 rollout and "
            "train step at SD3.5-Medium's size); skipped, and said so, without GPUs.",
        ),
    ] = False,
    bench_out: Annotated[
        Path, typer.Option("--out", help="Folder for the benchmark's gpu-bench.json and gpu-bench.md.")
    ] = Path("runs/gpu-bench"),
) -> None:
    """Check this machine: torch, CUDA, the GPUs and their links, NCCL, Redis, Dask, disk, the placement."""
    from digen.bench.doctor import doctor_report, format_report

    report = doctor_report(config)
    if gpu_bench:
        from digen.bench.gpu import run_gpu_bench

        report["gpu_bench"] = run_gpu_bench(bench_out, log=None if as_json else _say)
    if as_json:
        print(json.dumps(report, default=str), flush=True)
        return
    for line in format_report(report):
        out.print(line, highlight=False, markup=False, soft_wrap=True)


def _say(line: str) -> None:
    err.print(line, highlight=False, markup=False)
