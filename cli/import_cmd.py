"""``digen import-config``: a Flow-GRPO, VeRL-Omni, DanceGRPO or Flow-Factory recipe as a digen config."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from digen.cli.app import app, err, handles_errors, out
from digen.errors import ConfigError


@app.command("import-config")
@handles_errors
def import_config(
    peer: Annotated[str, typer.Argument(help="flow-grpo, verl-omni, dance-grpo or flow-factory.")],
    spec: Annotated[
        str,
        typer.Argument(
            help="flow-grpo: PATH/config/grpo.py:RECIPE; verl-omni: a composed config .yaml or an "
            "examples/**/*.sh launch script; dance-grpo: a scripts/finetune/*.sh script; flow-factory: an "
            "examples/**/*.yaml recipe."
        ),
    ],
    out_file: Annotated[
        Path | None, typer.Option("--out", help="YAML file to write; default: print it.")
    ] = None,
    gpus: Annotated[
        int | None,
        typer.Option(
            "--gpus", min=1, help="flow-grpo: GPUs the recipe's batch is sized for (default its gpu_number)."
        ),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing --out file.")] = False,
    overrides: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            help="Set a key of the imported config, as digen train's --set (--set model.device=auto); "
            "the written file carries it.",
        ),
    ] = None,
) -> None:
    """Write the digen config of a peer's recipe and list every key it could not carry, with why.
    The peer's files are read as data, never run."""
    from digen.config import parse_overrides
    from digen.importers import import_config as run_import
    from digen.importers import set_dotted

    result = run_import(peer, spec, gpus=gpus)
    for key, value in parse_overrides(overrides or []):
        set_dotted(result.config, key, value)
        result.placeholders.pop(key, None)
        result.overridden[key] = value
    result.validate()
    text = result.to_yaml()
    if out_file is None:
        sys.stdout.write(text)
        sys.stdout.flush()
        notes = err
    else:
        if out_file.exists() and not force:
            raise ConfigError(f"{out_file} exists (--force replaces it)")
        out_file.parent.mkdir(parents=True, exist_ok=True)
        out_file.write_text(text)
        out.print(f"[green]wrote[/green] {out_file} from {result.source}", highlight=False, soft_wrap=True)
        notes = out
    for key, why in result.placeholders.items():
        notes.print(f"[yellow]fill in[/yellow] {key}: {why}", highlight=False, soft_wrap=True)
    for key, why in result.dropped.items():
        notes.print(f"[dim]not carried[/dim] {key}: {why}", highlight=False, soft_wrap=True)
