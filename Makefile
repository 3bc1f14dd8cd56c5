# radixserve — the README's two commands are `make run` and `make test`; both set up what is missing.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_CPU_VERSION ?= 2.13.0
PYTEST_ARGS ?=

.PHONY: setup run test lint bench-cpu fetch-model clean

# One stamp per input: re-installs only when pyproject.toml changes.
$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	@$(PIP) install -q --upgrade pip
	@# torch first and pinned: a CPU build on machines without an NVIDIA GPU, never a CUDA one there.
	@if ! $(PY) -c "import torch" 2>/dev/null; then \
	  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then \
	    $(PIP) install -q torch; \
	  else \
	    $(PIP) install -q torch==$(TORCH_CPU_VERSION); \
	  fi; \
	fi
	@$(PIP) install -q -e ".[dev]"
	@touch $@

setup: $(VENV)/.installed

fetch-model: setup
	@$(VENV)/bin/radixserve model fetch

# NATS (RS_NATS_URL if it answers, else a local nats-server), tokenizer, worker + detokenizer and the
# gateway; prints the URL. PORT=8000 by default; extra engine flags go in RUN_ARGS.
PORT ?= 8000
RUN_ARGS ?=
run: fetch-model
	@$(VENV)/bin/radixserve up --port $(PORT) $(RUN_ARGS)

test: setup
	@$(PY) -m pytest -q -x --durations=15 $(PYTEST_ARGS)

lint: setup
	@$(VENV)/bin/ruff check services shared kernels tests bench

bench-cpu: fetch-model
	@$(PY) bench/cpu_scheduler.py
	@$(PY) bench/cpu_decode.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis

# gRPC stubs from proto/*.proto into services/gateway/proto_gen/ (gitignored; the gateway also
# regenerates them on import when they are missing or older than their .proto).
.PHONY: proto
proto: setup
	@$(PY) -m services.gateway.protos
