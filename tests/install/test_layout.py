"""What an install of digen puts where: one top-level module, ``digen``; ``cli/`` and
``workers/`` of the repository go inside it as ``digen.cli`` and ``digen.workers`` (setup.py's
``package_dir``; docs/install.md, "Layout"). A top-level ``cli`` or ``workers`` would shadow,
or be shadowed by, any other module of that name in the environment."""

from __future__ import annotations

import ast
import importlib.metadata
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MAPPED = {"digen.cli": "cli", "digen.workers": "workers"}


def setup_package_dir() -> dict[str, str]:
    """``setup.py``'s ``PACKAGE_DIR``, read without running setup()."""
    tree = ast.parse((REPO / "setup.py").read_text())
    (value,) = [
        n.value
        for n in tree.body
        if isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "PACKAGE_DIR" for t in n.targets)
    ]
    return ast.literal_eval(value)


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


@pytest.mark.slow
def test_the_wheel_has_one_top_level_module_digen(wheel: zipfile.ZipFile):
    tops = {n.split("/")[0] for n in wheel.namelist()}
    assert tops == {"digen", next(t for t in tops if t.endswith(".dist-info"))}, tops
    info = next(t for t in tops if t.endswith(".dist-info"))
    assert wheel.read(f"{info}/top_level.txt").decode().split() == ["digen"]


@pytest.mark.slow
def test_cli_and_workers_are_in_the_wheel_under_digen(wheel: zipfile.ZipFile):
    names = set(wheel.namelist())
    for package, folder in MAPPED.items():
        prefix = package.replace(".", "/")
        expected = {f"{prefix}/{f}" for f in sources(REPO / folder)}
        assert expected and expected <= names, sorted(expected - names)
    assert {f"digen/{f}" for f in sources(REPO / "digen")} <= names


@pytest.mark.slow
def test_the_wheel_script_runs_digen_cli(wheel: zipfile.ZipFile):
    info = next(n.split("/")[0] for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt"))
    text = wheel.read(f"{info}/entry_points.txt").decode()
    assert "digen = digen.cli.main:app" in text, text


@pytest.mark.slow
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


def test_the_checkout_links_the_mapped_folders_into_digen():
    """``digen/cli`` and ``digen/workers`` link to the folders setup.py maps, so the tools that
    walk ``digen/`` (``lint-imports``, the cycle check) see the installed layout."""
    assert setup_package_dir() == MAPPED
    for package, folder in MAPPED.items():
        link = REPO.joinpath(*package.split("."))
        assert link.is_symlink(), f"{link} is not a symbolic link"
        assert link.resolve() == (REPO / folder).resolve()
        assert sources(link) == sources(REPO / folder)


def test_the_import_graph_lint_imports_reads_has_the_mapped_packages():
    """grimp, which import-linter runs, finds ``digen.cli`` and ``digen.workers`` by walking
    ``digen/`` and the imports between them and the rest of digen."""
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph("digen", cache_dir=None)
    assert {"digen.cli.main", "digen.workers.loop", "digen.runtime.controller"} <= graph.modules
    assert graph.direct_import_exists(importer="digen.cli.main", imported="digen.cli.app")
    assert graph.direct_import_exists(importer="digen.workers.loop", imported="digen.controlplane.queue")


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
