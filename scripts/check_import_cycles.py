"""Fail when a module imports a module that imports it back: a 2-cycle of digen (digen.cli and
digen.workers included, found through the checkout's links ``digen/cli`` and ``digen/workers``), imports
inside functions included. import-linter's contracts (pyproject's
``[tool.importlinter]``) keep the layers; this keeps any two modules from leaning on each other.

An import under ``if TYPE_CHECKING:`` does not count, as import-linter's contracts do not count
it (``exclude_type_checking_imports``): it names a type for an annotation and loads nothing, so
it cannot form a cycle at run time. (The algorithm registry names ``Config`` so in
``Algorithm.check``'s signature, while the config checks ``train.algorithm`` in the registry.)

    python scripts/check_import_cycles.py        (``make lint`` runs it)

Exit 0: no 2-cycle but the listed :data:`EXCEPTIONS`; 1: a new 2-cycle (both imports printed
with their lines) or an exception that no longer happens (remove it from the list).
"""

from __future__ import annotations

import sys

import grimp

PACKAGES = ("digen",)

EXCEPTIONS: frozenset[frozenset[str]] = frozenset()
"""Pairs allowed to import each other (none now); each would say why beside it."""


def import_graph(*packages: str) -> grimp.ImportGraph:
    """The imports among ``packages`` that run: those under ``if TYPE_CHECKING:`` left out."""
    return grimp.build_graph(*packages, cache_dir=None, exclude_type_checking_imports=True)


def two_cycles(graph: grimp.ImportGraph) -> list[tuple[str, str]]:
    """Every pair ``(a, b)``, ``a < b``, of modules that import each other directly."""
    pairs = []
    for a in sorted(graph.modules):
        for b in sorted(graph.find_modules_directly_imported_by(a)):
            if a < b and graph.direct_import_exists(importer=b, imported=a):
                pairs.append((a, b))
    return pairs


def describe(graph: grimp.ImportGraph, a: str, b: str) -> str:
    """``a <-> b`` with the lines of both imports."""
    lines = [f"{a} <-> {b}"]
    for importer, imported in ((a, b), (b, a)):
        for d in graph.get_import_details(importer=importer, imported=imported):
            lines.append(f"    {importer} -> {imported} (l.{d['line_number']}: {d['line_contents']})")
    return "\n".join(lines)


def check(graph: grimp.ImportGraph, exceptions: frozenset[frozenset[str]] = EXCEPTIONS) -> list[str]:
    """The problems: new 2-cycles and exceptions that are no longer cycles."""
    found = two_cycles(graph)
    problems = [describe(graph, a, b) for a, b in found if frozenset({a, b}) not in exceptions]
    cycles = {frozenset(p) for p in found}
    problems += [
        f"{' <-> '.join(sorted(e))} is listed in EXCEPTIONS but is no longer a cycle: remove it"
        for e in sorted(exceptions - cycles, key=sorted)
    ]
    return problems


def main() -> int:
    graph = import_graph(*PACKAGES)
    problems = check(graph)
    for p in problems:
        print(p)
    if problems:
        print(
            f"{len(problems)} import cycle problem(s); break a cycle by moving what both need to a third module"
        )
        return 1
    print(f"no import 2-cycles in {', '.join(PACKAGES)} ({len(EXCEPTIONS)} listed exceptions)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
