"""scripts/check_import_cycles.py: two modules that import each other fail `make lint`."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import grimp
import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_import_cycles.py"


@pytest.fixture(scope="module")
def cycles():
    spec = importlib.util.spec_from_file_location("check_import_cycles", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def graph(*edges: tuple[str, str]) -> grimp.ImportGraph:
    g = grimp.ImportGraph()
    for i, (a, b) in enumerate(edges, start=1):
        g.add_import(importer=a, imported=b, line_number=i, line_contents=f"from {b} import x")
    return g


def test_a_pair_importing_each_other_is_reported_with_both_lines(cycles):
    g = graph(("pkg.a", "pkg.b"), ("pkg.b", "pkg.a"), ("pkg.b", "pkg.c"))
    assert cycles.two_cycles(g) == [("pkg.a", "pkg.b")]
    (problem,) = cycles.check(g, frozenset())
    assert problem.splitlines() == [
        "pkg.a <-> pkg.b",
        "    pkg.a -> pkg.b (l.1: from pkg.b import x)",
        "    pkg.b -> pkg.a (l.2: from pkg.a import x)",
    ]


def test_a_longer_circle_is_not_a_two_cycle(cycles):
    g = graph(("pkg.a", "pkg.b"), ("pkg.b", "pkg.c"), ("pkg.c", "pkg.a"))
    assert cycles.two_cycles(g) == []


def test_listed_exceptions_pass_and_stale_ones_fail(cycles):
    g = graph(("pkg.a", "pkg.b"), ("pkg.b", "pkg.a"))
    assert cycles.check(g, frozenset({frozenset({"pkg.a", "pkg.b"})})) == []
    stale = cycles.check(g, frozenset({frozenset({"pkg.a", "pkg.b"}), frozenset({"pkg.c", "pkg.d"})}))
    assert stale == ["pkg.c <-> pkg.d is listed in EXCEPTIONS but is no longer a cycle: remove it"]


def test_an_import_for_annotations_only_is_no_cycle(cycles, tmp_path, monkeypatch):
    pkg = tmp_path / "cyclepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from cyclepkg import b\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from cyclepkg import a\n"
    )
    (pkg / "c.py").write_text("from cyclepkg import d\n")
    (pkg / "d.py").write_text("def f():\n    from cyclepkg import c\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cycles.two_cycles(cycles.import_graph("cyclepkg")) == [("cyclepkg.c", "cyclepkg.d")]
