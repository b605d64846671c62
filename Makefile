# Two entry points for a fresh machine (see README):
#   make train   creates .venv, installs zerodp, trains the default GPT on stdlib prose (2 ranks, ZeRO-2)
#   make test    creates .venv, installs zerodp with test deps, runs the test suite
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/zerodp: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

.PHONY: install train test
install: $(BIN)/zerodp

train: install
	$(BIN)/zerodp train

test: install
	$(BIN)/python -m pytest -q tests
