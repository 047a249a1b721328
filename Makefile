# tgis: the two set-up commands are `make run` and `make test`; both start with `make install`.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch; an unpinned `torch` would pull several GB of CUDA packages.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# The suite runs on two workers, one per core (pytest-xdist; --dist loadfile keeps a module's
# tests, and the server its fixtures launch, on one worker; --no-loadscope-reorder keeps the
# longest-first order of tests/conftest.py). TEST_WORKERS=0: serially.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

.PHONY: install run test test-fast lint format protos tiny-model clean prometheus-tools guidellm image

install: $(VENV)/.installed tgis/pb/generation_pb2.py

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# HF's text-generation client (tests/e2e/test_tgi_e2e.py) pins huggingface-hub<1.0, which
# transformers cannot take: it is installed without its dependencies (the dev extra has them).
$(VENV)/.installed: $(VENV)/bin/python pyproject.toml setup.py tgis/shard/native/attention/csrc/cpu_attention.c \
		tgis/shard/native/linear/csrc/cpu_quant.c
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[dev]"
	$(BIN)/pip install --quiet --no-deps "text-generation==0.7.0"
	touch $@

tgis/pb/generation_pb2.py: $(VENV)/.installed protos/generation.proto protos/shard.proto scripts/gen_protos.py
	$(BIN)/python scripts/gen_protos.py

protos: tgis/pb/generation_pb2.py

run: install
	$(BIN)/text-generation-launcher

test: install prometheus-tools guidellm
	$(BIN)/python -m pytest $(XDIST) $(PYTEST_ARGS)

# The unit layer: all but the launched-server tests (tests/e2e, tests/deploy) and the
# modules marked slow; under two minutes on two cores (README.md, "Testing").
test-fast: install
	$(BIN)/python -m pytest $(XDIST) -m "not slow" --ignore=tests/e2e --ignore=tests/deploy \
		$(PYTEST_ARGS)

# promtool and prometheus for tests/e2e/test_prometheus.py: Debian's `prometheus` package,
# installed only when either binary is missing (as root, else with passwordless sudo). Without
# them that test skips, or fails under CI=true.
prometheus-tools:
	@if command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; then \
		exit 0; \
	fi; \
	if [ "$$(id -u)" = 0 ]; then sudo=""; \
	elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then sudo="sudo -n"; \
	else sudo=none; fi; \
	if [ "$$sudo" = none ] || ! command -v apt-get >/dev/null 2>&1; then \
		echo "prometheus-tools: promtool/prometheus missing and cannot apt-get install prometheus" >&2; \
		if [ "$${CI:-}" = true ]; then exit 1; fi; exit 0; \
	fi; \
	echo "prometheus-tools: apt-get install prometheus (promtool, prometheus)"; \
	$$sudo apt-get update -qq && \
	DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq --no-install-recommends \
		prometheus >/dev/null || { \
		echo "prometheus-tools: apt-get install prometheus failed" >&2; \
		if [ "$${CI:-}" = true ]; then exit 1; fi; }

# guidellm for tests/e2e/test_guidellm_e2e.py, in a venv of its own: it brings datasets, pandas
# and pyarrow and pins click, none of which .venv should get, and it requires torch (the CPU
# build .venv has, else pip would pick the CUDA one). The stamp names the pin, so changing it
# reinstalls. Where it cannot be installed the test skips, or fails under CI=true.
GUIDELLM_VENV ?= .venv-guidellm
GUIDELLM_VERSION ?= 0.8.1

guidellm: $(GUIDELLM_VENV)/.installed-$(GUIDELLM_VERSION)

$(GUIDELLM_VENV)/.installed-$(GUIDELLM_VERSION):
	@rm -rf $(GUIDELLM_VENV)
	@echo "guidellm: installing guidellm==$(GUIDELLM_VERSION) into $(GUIDELLM_VENV)"
	@{ $(PYTHON) -m venv $(GUIDELLM_VENV) && \
		$(GUIDELLM_VENV)/bin/pip install --quiet --upgrade pip && \
		$(GUIDELLM_VENV)/bin/pip install --quiet "$(TORCH_SPEC)" "guidellm==$(GUIDELLM_VERSION)" && \
		touch $@; } || { \
		echo "guidellm: could not install guidellm==$(GUIDELLM_VERSION)" >&2; \
		rm -rf $(GUIDELLM_VENV); \
		if [ "$${CI:-}" = true ]; then exit 1; fi; }

# Style, types, import contracts (pyproject's [tool.importlinter]) and the size rules
# (scripts/check_structure.py). tests/test_structure.py runs all but mypy in `make test`.
lint: install
	$(BIN)/ruff check tgis tests scripts benchmarks examples
	$(BIN)/ruff format --check tgis tests scripts benchmarks examples
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache
	$(BIN)/python scripts/check_structure.py

format: install
	$(BIN)/ruff format tgis tests scripts
	$(BIN)/ruff check --fix tgis tests scripts

# The container image (Dockerfile.ubi; TORCH_VARIANT=cpu for a CPU-only image).
CONTAINER_TOOL ?= podman
IMAGE ?= tgis:0.1.0
TORCH_VARIANT ?= cu130
image:
	$(CONTAINER_TOOL) build -f Dockerfile.ubi --build-arg TORCH_VARIANT=$(TORCH_VARIANT) -t $(IMAGE) .

# Rebuild the embedded tiny model (deterministic; a few minutes on CPU).
tiny-model: install
	$(BIN)/python scripts/build_tiny_model.py

clean:
	rm -rf $(VENV) $(GUIDELLM_VENV) build dist *.egg-info tgis/pb/*_pb2*.py tgis/pb/*_pb2*.pyi
