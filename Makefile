# tgis: the two set-up commands are `make run` and `make test`; both start with `make install`.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch; an unpinned `torch` would pull several GB of CUDA packages.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: install run test lint format protos tiny-model clean

install: $(VENV)/.installed tgis/pb/generation_pb2.py

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed: $(VENV)/bin/python pyproject.toml setup.py
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $@

tgis/pb/generation_pb2.py: $(VENV)/.installed protos/generation.proto protos/shard.proto scripts/gen_protos.py
	$(BIN)/python scripts/gen_protos.py

protos: tgis/pb/generation_pb2.py

run: install
	$(BIN)/text-generation-launcher

test: install
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check tgis tests scripts
	$(BIN)/ruff format --check tgis tests scripts
	$(BIN)/mypy

format: install
	$(BIN)/ruff format tgis tests scripts
	$(BIN)/ruff check --fix tgis tests scripts

# Rebuild the embedded tiny model (deterministic; a few minutes on CPU).
tiny-model: install
	$(BIN)/python scripts/build_tiny_model.py

clean:
	rm -rf $(VENV) build dist *.egg-info tgis/pb/*_pb2*.py tgis/pb/*_pb2*.pyi
