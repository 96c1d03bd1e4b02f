"""digen CLI commands: simulate and sp-bench (registered on digen.cli.app.app)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from digen.cli.app import app, err, handles_errors, out
from digen.cli.progress import Steps
from digen.errors import ConfigError

if TYPE_CHECKING:
    from digen.sim.dataplane import DataPlaneModel

SIM_CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "sim"


@app.command()
@handles_errors
def simulate(
    config: Annotated[
        Path | None,
        typer.Argument(
            help="Simulation config (configs/sim/*.yaml); with --all a folder of them (default configs/sim)."
        ),
    ] = None,
    modes: Annotated[
        str | None,
        typer.Option(
            "--modes", help="Comma-separated modes, or 'all' (default: colocated and the ablation ladder)."
        ),
    ] = None,
    json_out: Annotated[
        bool,
        typer.Option(
            "--json", help="Print one JSON object per mode instead of a table (with --all: per config)."
        ),
    ] = False,
    testbed: Annotated[
        str | None, typer.Option("--testbed", help="Simulate on another testbed of the catalog.")
    ] = None,
    gantt: Annotated[
        Path | None,
        typer.Option("--gantt", help="Gantt PNG of one simulated iteration (default runs/sim/<config>.png)."),
    ] = None,
    no_gantt: Annotated[bool, typer.Option("--no-gantt", help="Do not draw the Gantt chart.")] = False,
    all_: Annotated[
        bool, typer.Option("--all", help="Every config in the folder: the README results table.")
    ] = False,
    md_out: Annotated[
        Path | None, typer.Option("--out", help="With --all: also write the Markdown to this file.")
    ] = None,
    from_run: Annotated[
        Path | None,
        typer.Option(
            "--from-run",
            help="Calibrate the cost model from a run directory and compare prediction with measurement.",
        ),
    ] = None,
    calibration: Annotated[
        Path | None,
        typer.Option(
            "--calibration",
            help="Sequence-parallel efficiency measured by digen sp-bench (JSON) or from a run directory "
            "whose replicas carry sp_degree; replaces the catalog's cited constants at those degrees.",
        ),
    ] = None,
    optimize: Annotated[
        bool,
        typer.Option(
            "--optimize",
            help="Search the rollout/trainer split, train.groups_per_task and rollout.max_batch with the "
            "cost model; print the best plan beside the configured one.",
        ),
    ] = False,
    gpus: Annotated[
        str | None,
        typer.Option("--gpus", help="Another cluster of the catalog's GPU types: 64xh100, 32xl20,16xh20."),
    ] = None,
    validate: Annotated[
        bool,
        typer.Option(
            "--validate",
            help="Predict the peers' published figures (the configs of CONFIG's folder, default "
            "configs/sim) and print each prediction's error beside the band docs/simulator.md states.",
        ),
    ] = False,
    dataplane: Annotated[
        Path | None,
        typer.Option(
            "--dataplane",
            help="The bench-dataplane.json of `digen bench --dataplane` (or its folder), run on your "
            "cluster: its measured efficiencies replace the data plane's defaults.",
        ),
    ] = None,
) -> None:
    """Simulate a job's iterations through the real Scheduler with a cost model: per mode
    s/iteration, samples/s, bubble ratio, speedup vs colocated, fraction of the bound and the
    data plane's seconds per iteration (reduce, step, distribute, trajectory)."""
    from digen.sim.dataplane import DataPlaneModel
    from digen.sim.driver import parse_modes

    mode_list = parse_modes(modes)
    if validate:
        from digen.sim.validation import markdown_validation
        from digen.sim.validation import validate as predict_all

        folder = (
            config if config is not None and config.is_dir() else (config.parent if config else SIM_CONFIGS)
        )
        out.print(markdown_validation(predict_all(folder)), highlight=False, soft_wrap=True)
        return
    if from_run is not None:
        _from_run(from_run, mode_list if modes else [], json_out)
        return
    plane = DataPlaneModel.load(dataplane) if dataplane is not None else DataPlaneModel()
    if all_:
        _all(config or SIM_CONFIGS, mode_list, md_out, calibration, plane, json_out)
        return
    if config is None:
        raise ConfigError("CONFIG is missing: pass a configs/sim/*.yaml file, --all, or --from-run RUN_DIR")
    from digen.sim.catalog import load_sim_config
    from digen.sim.report import explain, json_rows, plot_gantt, text_table
    from digen.sim.study import run_study

    setup = load_sim_config(config, testbed=testbed, calibration=calibration, dataplane=plane, gpus=gpus)
    if optimize:
        _optimize(setup, modes)
        return
    with Steps(f"simulate {setup.name}", len(_simulated(mode_list))) as steps:
        study = run_study(setup.cost, mode_list, setup.settings, progress=steps.start)
    if not no_gantt:
        path = gantt or Path("runs") / "sim" / f"{config.stem}{'_' + testbed if testbed else ''}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        shown = [r.sim for r in study.results if r.mode in ("colocated", "disaggregated", "digen")]
        plot_gantt(shown or [r.sim for r in study.results[:3]], path, title=setup.name)
        err.print(f"gantt chart: {path}", highlight=False)
    if json_out:
        sp = [asdict(c) for c in setup.cost.sp]
        print(json.dumps([{**row, "sequence_parallel": sp} for row in json_rows(study)], indent=1))
        return
    out.print(
        f"[bold]{setup.name}[/bold]: {setup.cost.gpu_count} GPUs ({'; '.join(setup.cost.notes)}), "
        f"{setup.cost.samples} samples per iteration, bound {study.bound.x:.4g} samples/s",
        highlight=False,
    )
    for choice in setup.cost.sp:
        out.print(choice.describe(), highlight=False, soft_wrap=True)
    out.print(plane.describe(), highlight=False, soft_wrap=True)
    out.print(text_table(study), highlight=False, soft_wrap=True)
    note = explain(study)
    if note:
        out.print(note, highlight=False)


def _optimize(setup, modes: str | None) -> None:
    from digen.sim.planner import optimize, plan_table

    mode = modes.strip() if modes else "digen"
    if "," in mode:
        raise ConfigError(f"--optimize plans one mode; got --modes {modes}")
    err.print(f"planning {mode} on {setup.name} ({setup.cost.gpu_count} GPUs)...", highlight=False)
    search = optimize(setup, mode)
    out.print(f"[bold]{setup.name}[/bold]: {len(search.tried)} plans simulated", highlight=False)
    out.print(plan_table(search), highlight=False, soft_wrap=True)
    out.print(
        f"best: {search.best.s_per_iteration:.1f} s/iteration, {search.speedup:.2f}x the configured plan; "
        f"{search.best.settings()}",
        highlight=False,
        soft_wrap=True,
    )


def _simulated(modes: list[str]) -> list[str]:
    """The modes :func:`digen.sim.study.run_study` simulates for ``modes``: colocated too."""
    return list(dict.fromkeys(["colocated", *modes]))


def _all(
    folder: Path,
    mode_list: list[str],
    md_out: Path | None,
    calibration: Path | None,
    plane: DataPlaneModel,
    json_out: bool = False,
) -> None:
    """Every config of ``folder``: the README's Markdown tables, or with ``json_out`` one
    object per config (``workload``, ``testbed``, ``modes``: ``digen simulate --json``'s rows)."""
    from digen.sim.catalog import is_run_config, load_sim_config
    from digen.sim.report import explain, json_rows, markdown_dataplane, markdown_results, sp_summary
    from digen.sim.study import run_study

    if not folder.is_dir():
        raise ConfigError(f"--all needs a folder of simulation configs; {folder} is not one")
    files = sorted(p for p in folder.glob("*.yaml") if is_run_config(p))
    if not files:
        raise ConfigError(
            f"{folder} holds no simulation configs (YAML files naming a workload and a testbed)"
        )
    studies, notes = [], []
    modes = list(dict.fromkeys([*mode_list, "digen", "colocated-digen"]))
    with Steps("simulate --all", len(files) * len(_simulated(modes))) as steps:
        for p in files:
            setup = load_sim_config(p, calibration=calibration, dataplane=plane)
            err.print(f"simulating {setup.name} ({setup.cost.gpu_count} GPUs)", highlight=False)
            st = run_study(
                setup.cost, modes, setup.settings, progress=lambda m, n=setup.name: steps.start(f"{n} {m}")
            )
            studies.append((setup.workload.name, setup.testbed.name, st))
            notes.append(f"- {explain(st)} {sp_summary(setup.cost.sp)}")
    order = {"A": 0, "B": 1, "C": 2, "A+C": 3}
    ranked = sorted(
        range(len(studies)), key=lambda i: (studies[i][0], order.get(studies[i][1], 9), studies[i][1])
    )
    studies, notes = [studies[i] for i in ranked], [notes[i] for i in ranked]
    text = (
        markdown_results(studies)
        + "\n\nWhy (from the simulation):\n\n"
        + "\n".join(notes)
        + "\n\nData plane, seconds per iteration on a lane that pays it (the reduce and the step: every "
        + "trainer; distribute: a rollout worker; trajectory: a training worker):\n\n"
        + markdown_dataplane(studies)
        + f"\n\n{plane.describe()}\n"
    )
    if md_out is not None:
        md_out.parent.mkdir(parents=True, exist_ok=True)  # --out runs/sim/results.md on a fresh clone
        md_out.write_text(text)
    if json_out:
        rows = [{"workload": w, "testbed": t, "modes": json_rows(st)} for w, t, st in studies]
        print(json.dumps(rows, indent=1))
        return
    print(text)


def _from_run(run_dir: Path, modes: list[str], json_out: bool) -> None:
    from digen.sim.calibrate import compare_run, predict_modes

    own = compare_run(run_dir)
    rows = [own] + [c for c in predict_modes(run_dir, modes) if c.measured_samples_per_s is None]
    if json_out:
        print(json.dumps([c.to_json() for c in rows], indent=1))
        return
    for c in rows:
        meas = (
            f"measured {c.measured_samples_per_s:.4g} samples/s, bubble {c.measured_bubble_ratio:.3f} "
            f"(error {c.samples_per_s_error:+.1%})"
            if c.measured_samples_per_s is not None
            else "not measured"
        )
        out.print(
            f"{c.mode}: predicted {c.predicted_samples_per_s:.4g} samples/s, bubble "
            f"{c.predicted_bubble_ratio:.3f}; {meas}",
            highlight=False,
        )


@app.command("sp-bench")
@handles_errors
def sp_bench(
    out_file: Annotated[
        Path, typer.Option("--out", help="Calibration JSON to write (digen simulate --calibration FILE).")
    ] = Path("runs/sim/sp_calibration.json"),
    degree: Annotated[int, typer.Option("--sp", help="Sequence-parallel degree (ranks).")] = 2,
    resolution: Annotated[int, typer.Option("--resolution", help="Pixels (height = width).")] = 128,
    frames: Annotated[int, typer.Option("--frames", help="Video frames (4k + 1).")] = 17,
    steps: Annotated[int, typer.Option("--steps", help="Denoising steps.")] = 4,
    repeats: Annotated[int, typer.Option("--repeats", help="Timed generations per degree.")] = 3,
    warmup: Annotated[int, typer.Option("--warmup", help="Untimed generations per degree first.")] = 1,
    threads: Annotated[int, typer.Option("--threads", help="CPU threads per rank.")] = 1,
    workdir: Annotated[
        Path, typer.Option("--workdir", help="Folder for the tiny Wan and the rendezvous file.")
    ] = Path("runs/sim/sp_bench"),
) -> None:
    """Time tiny-Wan generation at d=1 and d=--sp over gloo (one process per rank) on this
    machine; print speedup and efficiency and write a calibration file. On CPUs this
    calibrates the mechanism, not GPU numbers."""
    from digen.sim.sp_bench import SpBenchSpec, run_sp_bench
    from digen.sim.sp_calibration import save_calibration

    spec = SpBenchSpec(degree, resolution, frames, steps, repeats=repeats, warmup=warmup, threads=threads)
    cal = run_sp_bench(spec, workdir)
    path = save_calibration(cal, out_file)
    d = degree
    out.print(
        f"sequence parallel {d}: {cal.gen_s_per_sample[1]:.4g} s/sample at d=1, {cal.gen_s_per_sample[d]:.4g} "
        f"at d={d} (median of {repeats}; {spec.tokens} tokens/sample, {steps} steps); speedup "
        f"{cal.speedup[d]:.3f}x, efficiency {cal.efficiency[d]:.3f}; d={d} latents within "
        f"{cal.setup['max_abs_latent_diff']:.2g} of d=1",
        highlight=False,
    )
    out.print(f"calibration: {path} ({cal.source})", highlight=False)
