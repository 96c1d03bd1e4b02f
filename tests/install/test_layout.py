"""What an install of digen puts where: one top-level module, ``digen``; ``cli/`` and
``workers/`` of the repository go inside it as ``digen.cli`` and ``digen.workers`` (setup.py's
``package_dir``; docs/install.md, "Layout"). A top-level ``cli`` or ``workers`` would shadow,
or be shadowed by, any other module of that name in the environment."""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MAPPED = {"digen.cli": "cli", "digen.workers": "workers"}


def sources(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*.py") if "__pycache__" not in p.parts}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """digen's wheel, built from a copy of the checkout (about 5 s; no build left in it)."""
    pytest.importorskip("setuptools")
    src = tmp_path_factory.mktemp("src")
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for name in ("digen", "cli", "workers"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    out = tmp_path_factory.mktemp("wheel")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "-w",
        str(out),
        str(src),
    ]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    (path,) = out.glob("digen-*.whl")
    return zipfile.ZipFile(path)


def test_the_wheel_has_one_top_level_module_digen(wheel: zipfile.ZipFile):
    tops = {n.split("/")[0] for n in wheel.namelist()}
    assert tops == {"digen", next(t for t in tops if t.endswith(".dist-info"))}, tops
    info = next(t for t in tops if t.endswith(".dist-info"))
    assert wheel.read(f"{info}/top_level.txt").decode().split() == ["digen"]


def test_cli_and_workers_are_in_the_wheel_under_digen(wheel: zipfile.ZipFile):
    names = set(wheel.namelist())
    for package, folder in MAPPED.items():
        prefix = package.replace(".", "/")
        expected = {f"{prefix}/{f}" for f in sources(REPO / folder)}
        assert expected and expected <= names, sorted(expected - names)
    assert {f"digen/{f}" for f in sources(REPO / "digen")} <= names


def test_the_wheel_script_runs_digen_cli(wheel: zipfile.ZipFile):
    info = next(n.split("/")[0] for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt"))
    text = wheel.read(f"{info}/entry_points.txt").decode()
    assert "digen = digen.cli.main:app" in text, text


def test_this_environment_installs_digen_alone_and_finds_the_mapped_folders():
    """The install this test runs in (``make setup``: editable) maps the same packages."""
    dist = importlib.metadata.distribution("digen")
    assert (dist.read_text("top_level.txt") or "digen").split() == ["digen"]
    (script,) = [e for e in dist.entry_points if e.group == "console_scripts" and e.name == "digen"]
    assert script.value == "digen.cli.main:app"
    import digen.cli.main
    import digen.workers.loop

    assert digen.cli.main.app is script.load()
    for module, folder in ((digen.cli.main, "cli"), (digen.workers.loop, "workers")):
        assert Path(module.__file__).parent.name == folder


def test_the_lint_view_has_the_installed_layout():
    """scripts/installed_layout.py (import-linter, the cycle check) reads setup.py's mapping."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from installed_layout import installed_layout, package_dir
    finally:
        sys.path.remove(str(REPO / "scripts"))
    assert package_dir() == MAPPED
    with installed_layout() as root:
        assert sources(root / "digen" / "cli") == sources(REPO / "cli")
        assert sources(root / "digen" / "workers") == sources(REPO / "workers")
        assert not (root / "cli").exists() and not (root / "workers").exists()


def test_every_module_the_fork_server_preloads_is_found():
    """The fork server skips a preload module it cannot import, silently: a stale name (such
    as ``workers.loop`` for ``digen.workers.loop``) would only make every worker start slower."""
    import importlib.util

    from digen.cluster.cluster import FORKSERVER_PRELOAD

    own = [
        m
        for m in FORKSERVER_PRELOAD
        if m.split(".")[0] not in ("distributed", "diffusers", "transformers", "peft")
    ]
    assert own and all(m.startswith("digen.") for m in own), own
    assert [m for m in own if importlib.util.find_spec(m) is None] == []
