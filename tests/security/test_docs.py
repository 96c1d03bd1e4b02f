"""docs/deploy.md states the threat model and lists every port a job's processes open."""

from __future__ import annotations

from pathlib import Path

DEPLOY = Path(__file__).resolve().parents[2] / "docs" / "deploy.md"


def section(text: str, title: str) -> str:
    start = text.index(title)
    end = text.find("\n## ", start + len(title))
    return text[start : end if end != -1 else len(text)]


def test_the_deploy_guide_has_the_threat_model_and_every_port():
    sec = section(DEPLOY.read_text(), "## 8. Security: threat model and ports")
    assert "**Trusted**" in sec and "**Untrusted**" in sec and "other users of the same host" in sec
    rows = [line for line in sec.splitlines() if line.startswith("| ") and "---" not in line]
    listed = " ".join(row.split("|")[1].lower() for row in rows[1:])
    for process in (
        "redis",
        "dask scheduler",
        "dashboard",
        "nanny",
        "dask worker",
        "blob server",
        "rendezvous",
        "gloo",
        "nccl",
    ):
        assert process in listed, f"the port table has no row for {process}"
    for row in rows[1:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 4 and all(cells), row  # process, port, bind address, protection
    assert "unauthenticated" in sec and "isolate" in sec.lower()


def test_every_scheduler_command_of_the_docs_keeps_the_dashboard_on_loopback():
    """A ``dask scheduler`` command as the docs give it serves its dashboard on 127.0.0.1:
    Dask's default is every interface (0.0.0.0:8787), which the port table says it is not."""
    docs = DEPLOY.parent
    commands = [
        (path.name, line.strip())
        for path in sorted(docs.rglob("*.md"))
        for line in path.read_text().splitlines()
        if line.strip().startswith("dask scheduler")
    ]
    assert commands, "the docs give no dask scheduler command"
    for name, line in commands:
        assert "--dashboard-address 127.0.0.1:" in line, f"{name}: {line}"
