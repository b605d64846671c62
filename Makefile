# Two entry points for a fresh machine (see README):
#   make train   creates .venv, installs zerodp alone (`pip install -e .`), trains the default GPT on
#                stdlib prose (ZeRO-2; 2 CPU ranks, or one rank per GPU on a CUDA machine)
#   make test    creates .venv, installs zerodp with its test dependencies (`.[dev]`), runs the test suite
#   make gpu-check  on an NVIDIA GPU machine: tools/gpu_check.sh (installs a CUDA torch into .venv-gpu,
#                runs the CUDA checks, writes gpu_check_out/gpu_check.json; see docs/gpu.md)
#   make test-unit  the in-process tier alone (tests/unit: no torchrun, under a minute); make test runs it too
#   make lint   ruff check and ruff format --check on src, tests and tools, then mypy on src/zerodp
#                (all configured in pyproject.toml); .ci/run runs it before make test
#   make typecheck  mypy alone
#   make mutants applies named faults to a copy of src/ one at a time; each must fail its tests (slow,
#                not part of make test); prints "N/N mutants killed" last
# Both install the torch pinned in constraints.txt (`pip install -c constraints.txt`), so the demo and the
# tests run on the same torch. On a machine without a GPU, `make train TORCH_INDEX=https://download.pytorch.org/whl/cpu`
# takes torch's CPU wheel (no CUDA packages) where pip's configured indexes offer only the CUDA one.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_INDEX ?=
PIP_INSTALL := $(BIN)/pip install -q -c constraints.txt $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml constraints.txt | $(BIN)/python
	$(PIP_INSTALL) -e .
	touch $@

$(VENV)/.installed-dev: pyproject.toml constraints.txt | $(BIN)/python
	$(PIP_INSTALL) -e '.[dev]'
	touch $@

.PHONY: install train test test-unit lint typecheck mutants gpu-check
install: $(VENV)/.installed-dev

train: $(VENV)/.installed
	$(BIN)/zerodp train

test: $(VENV)/.installed-dev
	$(BIN)/python -m pytest -q tests

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check src tests tools
	$(BIN)/ruff format --check src tests tools
	$(BIN)/mypy

typecheck: $(VENV)/.installed-dev
	$(BIN)/mypy

test-unit: $(VENV)/.installed-dev
	$(BIN)/python -m pytest -q tests/unit

mutants: install
	$(BIN)/python tools/mutants.py

gpu-check:
	bash tools/gpu_check.sh
