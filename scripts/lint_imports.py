"""import-linter's contracts (pyproject's ``[tool.importlinter]``) on digen as installed, with
``digen.cli`` and ``digen.workers`` where the install puts them (:mod:`installed_layout`).

    python scripts/lint_imports.py        (``make lint`` runs it)

Plain ``lint-imports`` walks only ``digen/`` and stops at "Missing layer 'digen.cli'". Exit 0:
every contract kept; 1: a broken contract, printed by import-linter.
"""

from __future__ import annotations

import os
import sys

from importlinter.cli import lint_imports
from installed_layout import REPO, installed_layout


def main() -> int:
    with installed_layout() as root:
        os.chdir(root)  # import-linter puts the working directory first on sys.path
        return lint_imports(config_filename=str(REPO / "pyproject.toml"), no_cache=True)


if __name__ == "__main__":
    sys.exit(main())
