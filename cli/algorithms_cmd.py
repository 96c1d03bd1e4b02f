"""digen CLI: ``algorithms``, the registered training algorithms and their peers."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from digen.cli.app import app, handles_errors, out, print_table


@app.command("algorithms")
@handles_errors
def algorithms(
    json_: Annotated[bool, typer.Option("--json", help="One JSON object per algorithm, in a list.")] = False,
) -> None:
    """List the training algorithms (train.algorithm): the peer each restates, what its
    rollout needs, what its trajectory holds (docs/algorithms.md)."""
    from digen.algos.registry import algorithms as registered

    rows = [
        {
            "name": a.name,
            "title": a.title,
            "peer": a.peer,
            "rollout": a.rollout_needs,
            "trajectory": a.trajectory,
            "modes": "every mode, not train.fsdp" if a.keeps_state else "every mode",
            "summary": a.summary,
        }
        for a in registered()
    ]
    if json_:
        print(json.dumps(rows, indent=1), flush=True)
        return
    from rich.table import Table

    table = Table(box=None, header_style="bold", show_lines=True)
    for col in ("ALGORITHM", "PEER", "ROLLOUT NEEDS", "TRAJECTORY HOLDS", "MODES"):
        table.add_column(col, overflow="fold")
    for r in rows:
        holds = "\n".join(f"{k} {_shape(v)}" for k, v in r["trajectory"].items())
        table.add_row(f"[bold]{r['name']}[/bold]\n{r['title']}", r["peer"], r["rollout"], holds, r["modes"])
    print_table(table)
    out.print(
        "train.algorithm selects one; train.mini_batches sets the optimizer steps per rollout batch; "
        "rollout.guidance_scale 1 with train.kl_target velocity is no-CFG training (docs/algorithms.md).",
        highlight=False,
    )


def _shape(doc: str) -> str:
    """The ``[...]`` shape a trajectory field's description starts with."""
    return doc[: doc.index("]") + 1] if doc.startswith("[") and "]" in doc else doc
