# One entry point for people and CI. `make setup` is idempotent: it reinstalls only when a
# pyproject.toml or requirements file changed since the last install.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The local CPU wheel here; on a GPU machine the same pin from PyPI is the CUDA build, or set
# TORCH_SPEC / PIP_EXTRA_INDEX_URL to pick another CUDA variant (see README).
TORCH_SPEC ?= torch==2.13.0
PACKAGES := libs/megacore $(wildcard tools/mega-*)
STAMP := $(VENV)/.installed
DEPS := Makefile requirements-dev.txt $(foreach p,$(PACKAGES),$(p)/pyproject.toml)
PYTEST_ARGS ?=
export OMP_NUM_THREADS ?= 1
export TOKENIZERS_PARALLELISM ?= false
export WANDB_MODE ?= offline
export HF_HUB_OFFLINE ?= 1

.PHONY: setup test test-slow test-all demo bench lint format schemas clean

setup: $(STAMP)

$(STAMP): $(DEPS)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(PY) -m pip install -q --disable-pip-version-check $(foreach p,$(PACKAGES),-e $(p)) -r requirements-dev.txt
	@touch $(STAMP)

test: setup
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

test-slow: setup
	$(PY) -m pytest -m slow $(PYTEST_ARGS)

test-all: setup
	$(PY) -m pytest $(PYTEST_ARGS)

demo: setup
	$(PY) examples/demo.py demo-out

bench: setup
	$(PY) bench/run.py $(BENCH_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

schemas: setup
	$(PY) -c "from megacore.artifacts.manifest import write_schemas; print(*write_schemas('schemas'), sep='\n')"

clean:
	rm -rf $(VENV) demo-out bench-out
