# digen: every target does its own set-up on a fresh machine (Python 3.11+, pip).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The torch that development and CI pin (a CPU build on a machine without GPUs);
# users install whatever torch build suits their GPUs (README, Install).
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup demo test test-fast lint docs bench simulate clean

$(STAMP): pyproject.toml setup.py
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev,rewards,docs]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)  ## a short real training run on the embedded default
	$(BIN)/digen train configs/quickstart.yaml --out runs/quickstart

test: $(STAMP)  ## the whole test suite (what CI runs)
	$(BIN)/python -m pytest -q -p no:cacheprovider

test-fast: $(STAMP)  ## unit tests only: no Dask cluster, no process of their own (skips the tests marked slow)
	$(BIN)/python -m pytest -q -m "not slow"

lint: $(STAMP)  ## ruff, mypy on the typed core, the import contracts (pyproject) and no import 2-cycles
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy digen/core digen/algos digen/config digen/seeding.py digen/runtime digen/controlplane digen/workers
	$(BIN)/lint-imports --no-cache
	$(BIN)/python scripts/check_import_cycles.py

docs: $(STAMP)  ## the documentation site (MkDocs, mkdocs.yml) into site/; a broken link fails it
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

bench: $(STAMP)
	$(BIN)/digen bench configs/quickstart.yaml --out runs/bench

simulate: $(STAMP)
	$(BIN)/digen simulate --all --out runs/sim/results.md

clean:
	rm -rf runs site .pytest_cache .mypy_cache .ruff_cache
