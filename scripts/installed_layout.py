"""digen's code as an install lays it out, for the tools that find modules by their folders.

The repository keeps ``cli/`` and ``workers/`` beside ``digen/``; an install puts them inside
digen as ``digen.cli`` and ``digen.workers`` (``setup.py``'s ``PACKAGE_DIR``; docs/install.md,
"Layout"). Python finds them there through the install (a wheel's copy, or the import hook of
``pip install -e .``), but grimp, under import-linter and ``scripts/check_import_cycles.py``,
walks ``digen/`` on disk and would see neither. :func:`installed_layout` copies the three
folders into a temporary folder in the installed shape, where a module's name is its path.

    python scripts/lint_imports.py        (``make lint``: import-linter on that layout)
"""

from __future__ import annotations

import ast
import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def package_dir() -> dict[str, str]:
    """``setup.py``'s ``PACKAGE_DIR`` (installed package -> folder), read without running it."""
    tree = ast.parse((REPO / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            getattr(t, "id", None) == "PACKAGE_DIR" for t in node.targets
        ):
            return ast.literal_eval(node.value)
    raise LookupError("setup.py assigns no PACKAGE_DIR")


@contextlib.contextmanager
def installed_layout() -> Iterator[Path]:
    """A temporary folder holding ``digen/`` with every mapped folder inside it, under its
    installed name; removed on exit."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    with tempfile.TemporaryDirectory(prefix="digen-layout-") as tmp:
        root = Path(tmp)
        shutil.copytree(REPO / "digen", root / "digen", ignore=ignore)
        for name, folder in package_dir().items():
            shutil.copytree(REPO / folder, root.joinpath(*name.split(".")), ignore=ignore)
        yield root
