#!/usr/bin/env bash
# The device check (scripts/gpu_check.py): under 8 minutes on one GPU, every step time-boxed.
# Uses the machine's own python and torch (PYTHON, default python3); where the checkout carries
# a wheelhouse (./wheelhouse/*.whl: digen's dependencies the machine lacks, built elsewhere with
# `pip wheel -w wheelhouse ...`), installs it first with no index (at most 40 s), into a venv that
# sees the machine's packages, torch included. Arguments go to gpu_check.py (--out DIR, --dry-run).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if ! "$PY" -c "import torch" 2>/dev/null; then
    echo "gpu_check: $PY has no torch; set PYTHON to a python with the machine's torch" >&2
    exit 2
fi
if compgen -G "wheelhouse/*.whl" >/dev/null; then
    VENV="${GPU_CHECK_VENV:-.gpu-check-venv}"
    [ -x "$VENV/bin/python" ] || "$PY" -m venv --system-site-packages "$VENV"
    timeout 40 "$VENV/bin/python" -m pip install --quiet --no-index --find-links wheelhouse wheelhouse/*.whl \
        || echo "gpu_check: the wheelhouse did not install within 40 s; going on with what is there" >&2
    PY="$VENV/bin/python"
fi
exec "$PY" scripts/gpu_check.py "$@"
