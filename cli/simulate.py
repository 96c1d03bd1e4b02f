"""digen CLI commands: simulate (registered on cli.main.app)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from cli.main import app, err, handles_errors, out
from digen.errors import ConfigError

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
        bool, typer.Option("--json", help="Print one JSON object per mode instead of a table.")
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
) -> None:
    """Simulate a job's iterations through the real Scheduler with a cost model: per mode
    s/iteration, samples/s, bubble ratio, speedup vs colocated and fraction of the bound."""
    from digen.sim.driver import parse_modes

    mode_list = parse_modes(modes)
    if from_run is not None:
        _from_run(from_run, mode_list if modes else [], json_out)
        return
    if all_:
        _all(config or SIM_CONFIGS, mode_list, md_out)
        return
    if config is None:
        raise ConfigError("CONFIG is missing: pass a configs/sim/*.yaml file, --all, or --from-run RUN_DIR")
    from digen.sim.catalog import load_sim_config
    from digen.sim.report import explain, json_rows, plot_gantt, text_table
    from digen.sim.study import run_study

    setup = load_sim_config(config, testbed=testbed)
    study = run_study(setup.cost, mode_list, setup.settings)
    if not no_gantt:
        path = gantt or Path("runs") / "sim" / f"{config.stem}{'_' + testbed if testbed else ''}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        shown = [r.sim for r in study.results if r.mode in ("colocated", "disaggregated", "digen")]
        plot_gantt(shown or [r.sim for r in study.results[:3]], path, title=setup.name)
        err.print(f"gantt chart: {path}", highlight=False)
    if json_out:
        print(json.dumps(json_rows(study), indent=1))
        return
    out.print(
        f"[bold]{setup.name}[/bold]: {setup.cost.gpu_count} GPUs ({'; '.join(setup.cost.notes)}), "
        f"{setup.cost.samples} samples per iteration, bound {study.bound.x:.4g} samples/s",
        highlight=False,
    )
    out.print(text_table(study), highlight=False, soft_wrap=True)
    note = explain(study)
    if note:
        out.print(note, highlight=False)


def _all(folder: Path, mode_list: list[str], md_out: Path | None) -> None:
    from digen.sim.catalog import is_run_config, load_sim_config
    from digen.sim.report import explain, markdown_results
    from digen.sim.study import run_study

    if not folder.is_dir():
        raise ConfigError(f"--all needs a folder of simulation configs; {folder} is not one")
    files = sorted(p for p in folder.glob("*.yaml") if is_run_config(p))
    if not files:
        raise ConfigError(
            f"{folder} holds no simulation configs (YAML files naming a workload and a testbed)"
        )
    studies, notes = [], []
    for p in files:
        setup = load_sim_config(p)
        err.print(f"simulating {setup.name} ({setup.cost.gpu_count} GPUs)", highlight=False)
        st = run_study(
            setup.cost, list(dict.fromkeys([*mode_list, "digen", "colocated-digen"])), setup.settings
        )
        studies.append((setup.workload.name, setup.testbed.name, st))
        notes.append(f"- {explain(st)}")
    order = {"A": 0, "B": 1, "C": 2, "A+C": 3}
    ranked = sorted(
        range(len(studies)), key=lambda i: (studies[i][0], order.get(studies[i][1], 9), studies[i][1])
    )
    studies, notes = [studies[i] for i in ranked], [notes[i] for i in ranked]
    text = markdown_results(studies) + "\n\nWhy (from the simulation):\n\n" + "\n".join(notes) + "\n"
    if md_out is not None:
        md_out.parent.mkdir(parents=True, exist_ok=True)  # --out runs/sim/results.md on a fresh clone
        md_out.write_text(text)
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
