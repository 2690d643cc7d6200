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

.PHONY: setup airflow-venv test test-slow test-all demo bench bench-check gpu-check lint format schemas docs clean

setup: $(STAMP)

$(STAMP): $(DEPS)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(PY) -m pip install -q --disable-pip-version-check $(foreach p,$(PACKAGES),-e $(p)) -r requirements-dev.txt
	@touch $(STAMP)

# Airflow, for the DAG's tests, lives in a venv of its own (its pinned dependencies would fight the
# tools'); the tests find it through MEGA_AIRFLOW_VENV and run the tools from $(VENV). Built once
# per requirements-airflow.txt. A failed install does not fail `make test`: it leaves
# $(AIRFLOW_FAILED) holding pip's last error line, the Airflow tests skip naming it, and the next
# try comes when requirements-airflow.txt changes or after `rm -r $(AIRFLOW_VENV)`.
AIRFLOW_VENV ?= .venv-airflow
AIRFLOW_STAMP := $(AIRFLOW_VENV)/.installed
AIRFLOW_FAILED := $(AIRFLOW_VENV)/.install-failed
AIRFLOW_LOG := $(AIRFLOW_VENV)/.install.log
export MEGA_AIRFLOW_VENV := $(abspath $(AIRFLOW_VENV))

airflow-venv: $(AIRFLOW_STAMP)

$(AIRFLOW_STAMP): requirements-airflow.txt
	@mkdir -p $(AIRFLOW_VENV) && rm -f $(AIRFLOW_FAILED)
	@echo "airflow-venv: installing requirements-airflow.txt into $(AIRFLOW_VENV) (once; a minute or two)"
	@if { test -x $(AIRFLOW_VENV)/bin/python || $(PYTHON) -m venv $(AIRFLOW_VENV); } > $(AIRFLOW_LOG) 2>&1 && \
	    $(AIRFLOW_VENV)/bin/python -m pip install -q --disable-pip-version-check \
	      -r requirements-airflow.txt >> $(AIRFLOW_LOG) 2>&1; then \
	  echo "airflow-venv: installed"; \
	else \
	  { grep '^ERROR' $(AIRFLOW_LOG) || grep . $(AIRFLOW_LOG) || echo "no output"; } | tail -n 1 > $(AIRFLOW_FAILED); \
	  echo "airflow-venv: install failed (the Airflow tests will skip): $$(cat $(AIRFLOW_FAILED))"; \
	  echo "airflow-venv: full log in $(AIRFLOW_LOG)"; \
	fi
	@touch $@

test: setup airflow-venv
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

test-slow: setup
	$(PY) -m pytest -m slow $(PYTEST_ARGS)

test-all: setup airflow-venv
	$(PY) -m pytest $(PYTEST_ARGS)

# `make demo FAMILY=qwen3`: the same chain on a tiny Qwen 3 (tied embeddings under pp), in demo-out-qwen3.
demo: setup
	$(PY) examples/demo.py demo-out$(if $(FAMILY),-$(FAMILY) --family $(FAMILY))

bench: setup
	$(PY) bench/run.py $(BENCH_ARGS)

# Before landing a change to the training step, the engine, the allocator or a loss: the trainer,
# LoRA and DPO against their peers in a few paired rounds, failing when a ratio falls more than 10%
# below bench/README.md's guarded figure (bench/check.py). Not part of `make test`: timings drift.
bench-check: setup
	$(PY) bench/check.py $(BENCH_ARGS)

# The GPU checks as one run of under 8 minutes on one GPU, one JSON report (bench/gpu_check.py, how
# to run it on a lent GPU: bench/README.md). $(PYTHON) with the sources on PYTHONPATH, not $(VENV):
# a GPU machine has its own torch and no network for `make setup`. Without CUDA every part skips.
GPU_CHECK_OUT ?= bench-out/gpu-check.json
empty :=
SRC_PATH := $(subst $(empty) ,:,libs/megacore/src $(wildcard tools/mega-*/src))

gpu-check:
	PYTHONPATH=$(SRC_PATH)$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON) bench/gpu_check.py --out $(GPU_CHECK_OUT) $(GPU_CHECK_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

schemas: setup
	$(PY) -c "from megacore.artifacts.codec import write_schemas; print(*write_schemas('schemas'), sep='\n')"

docs: setup
	$(PY) docs/gen_help.py

clean:
	rm -rf $(VENV) $(AIRFLOW_VENV) demo-out demo-out-* bench-out
