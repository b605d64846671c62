# Two entry points for a fresh machine (see README):
#   make train   creates .venv, installs zerodp alone (`pip install -e .`), trains the default GPT on
#                stdlib prose (2 ranks, ZeRO-2)
#   make test    creates .venv, installs zerodp with its test dependencies (`.[dev]`), runs the test suite
#   make gpu-check  on an NVIDIA GPU machine: tools/gpu_check.sh (installs a CUDA torch into .venv-gpu,
#                runs the CUDA checks, writes gpu_check_out/gpu_check.json; see docs/gpu.md)
#   make mutants applies named faults to a copy of src/ one at a time; each must fail its tests (slow,
#                not part of make test); prints "N/N mutants killed" last
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.installed-dev: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

.PHONY: install train test mutants gpu-check
install: $(VENV)/.installed-dev

train: $(VENV)/.installed
	$(BIN)/zerodp train

test: $(VENV)/.installed-dev
	$(BIN)/python -m pytest -q tests

mutants: install
	$(BIN)/python tools/mutants.py

gpu-check:
	bash tools/gpu_check.sh
