"""``digen export``: a run's trained weights as a diffusers LoRA or pipeline folder."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from digen.cli.app import app, handles_errors, out


@app.command("export")
@handles_errors
def export(
    run_dir: Annotated[Path, typer.Argument(help="Run directory of `digen train` (holds checkpoints/).")],
    out_dir: Annotated[Path, typer.Option("--out", help="Folder to write (must be empty, or --force).")],
    checkpoint: Annotated[
        int | None, typer.Option("--checkpoint", help="Iteration of the checkpoint; default the newest.")
    ] = None,
    merge: Annotated[
        bool,
        typer.Option(
            "--merge", help="Write a full pipeline folder with the LoRA merged into the transformer."
        ),
    ] = False,
    force: Annotated[bool, typer.Option("--force", help="Replace a non-empty --out folder.")] = False,
    ema: Annotated[
        bool | None,
        typer.Option(
            "--ema/--no-ema",
            help="Export the checkpoint's EMA weights (train.ema), or the policy's; "
            "default: as the run's train.ema.export says.",
        ),
    ] = None,
    model_path: Annotated[
        Path | None,
        typer.Option(
            "--model-path", help="Base pipeline folder, if it moved since training (default model.path)."
        ),
    ] = None,
) -> None:
    """Export trained weights: a LoRA folder for `pipeline.load_lora_weights(DIR)`, or with --merge
    (always for a full fine-tune) a pipeline folder for `DiffusionPipeline.from_pretrained(DIR)`."""
    from digen.export import export_run

    r = export_run(
        run_dir, out_dir, iteration=checkpoint, merge=merge, force=force, model_path=model_path, ema=ema
    )
    what = ("LoRA" if r.kind == "lora" else "pipeline") + (" (EMA weights)" if r.weights == "ema" else "")
    out.print(
        f"[green]exported[/green] {r.family} {what} from {r.checkpoint} (iteration {r.iteration}, "
        f"policy v{r.policy_version}) to {r.out_dir}",
        highlight=False,
    )
    if r.kind == "lora":
        out.print(
            f"load it: pipe = {r.pipeline_class}.from_pretrained({r.base_model!r}); "
            f"pipe.load_lora_weights({r.out_dir!r})",
            highlight=False,
            soft_wrap=True,
        )
    else:
        out.print(
            f"load it: DiffusionPipeline.from_pretrained({r.out_dir!r})", highlight=False, soft_wrap=True
        )
