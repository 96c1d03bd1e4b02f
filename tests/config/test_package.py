"""digen.config as a package: the schema, the loading and the tables of names, every public name
of the three importable from ``digen.config``; importing it loads no torch, Dask or Redis; and
the schema reaches no algorithm, so the algorithm registry, which names the schema's types,
and the loading, which runs the registry's checks, form no circle."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys

import grimp
import pytest

import digen.config
from digen.config import load, names, schema


def _public(module) -> set[str]:
    """The names ``module`` defines at its top level (classes, functions, assigned constants)."""
    found: set[str] = set()
    for node in ast.parse(inspect.getsource(module)).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            found.add(node.name)
        elif isinstance(node, ast.Assign):
            found |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            found.add(node.target.id)
    return {n for n in found if not n.startswith("_")}


@pytest.mark.parametrize("module", [schema, load, names], ids=lambda m: m.__name__)
def test_every_public_name_is_importable_from_the_package(module):
    public = _public(module)
    assert public
    assert public <= set(digen.config.__all__), sorted(public - set(digen.config.__all__))
    for name in public:
        assert getattr(digen.config, name) is getattr(module, name), name


def test_the_package_exports_nothing_its_modules_do_not_define():
    defined = _public(schema) | _public(load) | _public(names)
    assert set(digen.config.__all__) == defined


def test_the_schema_reaches_no_algorithm_so_the_registry_makes_no_circle():
    """With the imports for annotations counted (what a reader and mypy follow), neither the
    schema nor the tables of names lead into digen.algos, while the registry names the schema
    and the loading imports the registry."""
    graph = grimp.build_graph("digen", cache_dir=None, exclude_type_checking_imports=False)
    for module in ("digen.config.schema", "digen.config.names"):
        assert not graph.chain_exists(importer=module, imported="digen.algos", as_packages=True), module
    assert "digen.config.schema" in graph.find_modules_directly_imported_by("digen.algos.registry")
    assert not graph.chain_exists(importer="digen.algos.registry", imported="digen.config.load")
    assert graph.direct_import_exists(importer="digen.config.load", imported="digen.algos.registry")


@pytest.mark.slow
def test_importing_the_config_stays_light():
    code = (
        "import sys, digen.config; "
        "bad = [m for m in ('torch', 'dask', 'distributed', 'redis', 'rq') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
