# specserve developer tasks. On a fresh machine: `make serve` or `make test`.
#
# torch is installed pinned, and before the project, so pip never resolves an unpinned torch
# (which on Linux pulls the large CUDA wheels). Override on the command line, e.g.
#   make install TORCH_VERSION=2.13.0 TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"

PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
TORCH_SPEC ?= torch==$(TORCH_VERSION)
TORCH_PIP_ARGS ?=
PYTEST_ARGS ?= -q --durations=20

BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.DEFAULT_GOAL := help
.PHONY: help install pull test lint serve bench

help:
	@echo "make serve    install what is missing, pull the default model, start the server on :8000"
	@echo "make test     install what is missing, pull the default model, run the tests"
	@echo "make install  create $(VENV) with $(TORCH_SPEC) and the project (editable, dev extras)"
	@echo "make pull     pull the default model into the cache (\$$SPECSERVE_CACHE_DIR)"
	@echo "make lint     ruff check ."
	@echo "make bench    offline benchmark on the default model"

# The stamp makes repeated runs instant; it is redone when pyproject.toml changes.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install '$(TORCH_SPEC)' $(TORCH_PIP_ARGS)
	$(BIN)/python -m pip install -e '.[dev]'
	$(BIN)/python -m engine.kernels.build
	touch $@

install: $(STAMP)

pull: install
	$(BIN)/specserve pull

test: install pull
	$(BIN)/ruff check .
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check .

# The OpenAI-compatible server on the embedded default model, http://127.0.0.1:8000/v1
HOST ?= 127.0.0.1
PORT ?= 8000
serve: install pull
	$(BIN)/specserve serve --host $(HOST) --port $(PORT)

bench: install pull
	$(BIN)/specserve bench offline
