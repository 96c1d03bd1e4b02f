"""The one piece of digen's packaging that pyproject.toml cannot say: which packages go where.

The repository keeps the command line (``cli/``) and the worker loops (``workers/``) at its top
level, beside ``digen/``, but installs them inside digen's namespace as ``digen.cli`` and
``digen.workers`` (``package_dir``), so an install adds one top-level module, ``digen``, and
nothing named ``cli`` or ``workers`` that could shadow another project's. The package list is
found, not written out, so a new subpackage of ``digen/`` ships without an edit here
(docs/install.md, "Layout"; ``tests/install/test_layout.py`` checks the mapping).

The checkout also has ``digen/cli`` and ``digen/workers`` as symbolic links to the two folders,
so that tools which find modules by walking ``digen/`` (import-linter, grimp, an editor) see the
installed layout. The links are skipped here and the mapping alone decides what installs, so a
clone without symbolic links (``core.symlinks=false``) installs the same package.
"""

from setuptools import find_packages, setup

PACKAGE_DIR = {"digen.cli": "cli", "digen.workers": "workers"}
"""Installed package -> its folder in the repository (the rest: ``digen.*`` -> ``digen/``)."""


def packages() -> list[str]:
    """``digen`` and its subpackages, then the mapped folders under their installed names."""
    mapped = [pattern for name in PACKAGE_DIR for pattern in (name, f"{name}.*")]
    found = find_packages(include=["digen", "digen.*"], exclude=mapped)
    for name, folder in PACKAGE_DIR.items():
        found.append(name)
        found += [f"{name}.{sub}" for sub in find_packages(where=folder)]
    return found


setup(packages=packages(), package_dir=PACKAGE_DIR)
