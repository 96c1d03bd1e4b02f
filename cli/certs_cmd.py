"""``digen certs``: a cluster's CA and one TLS certificate per node (:mod:`digen.cluster.certs`)."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from digen.cli.app import app, err, handles_errors


@app.command("certs")
@handles_errors
def certs(
    out_dir: Annotated[Path, typer.Argument(help="Folder for the CA and the nodes' folders (made 0700).")],
    hosts: Annotated[
        list[str] | None,
        typer.Option(
            "--hosts",
            help="Node names (host names or IP addresses), comma-separated or repeated; "
            "default: this machine's host name.",
        ),
    ] = None,
    days: Annotated[int, typer.Option("--days", help="Validity of the node certificates.")] = 365,
) -> None:
    """Make a cluster CA and a certificate and key per node, for tls:// Dask and the blob servers:
    OUT/NAME/security.yaml is that node's --security file. Run again to add nodes (the CA and
    existing nodes' files are kept)."""
    from digen.cluster.certs import make_certs

    names = [n.strip() for item in (hosts or []) for n in item.split(",") if n.strip()]
    made = make_certs(out_dir, names or [socket.gethostname().split(".")[0] or "localhost"], days=days)
    for node in made:
        what = "made" if node.created else "kept (exists)"
        err.print(
            f"{escape(node.name)}: {what}: --security {escape(str(node.folder / 'security.yaml'))}",
            highlight=False,
        )
    err.print(
        f"CA: {escape(str(out_dir / 'ca.pem'))}; keep {escape(str(out_dir / 'ca.key'))} off the nodes",
        highlight=False,
    )
