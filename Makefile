# radixserve — the README's two commands are `make run` and `make test`; both set up what is missing.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_CPU_VERSION ?= 2.13.0
PYTEST_ARGS ?=
# make test runs the modules over this many pytest-xdist processes, a module's tests together in one
# (--dist loadfile: module fixtures such as a started stack are built once). Most of the suite waits on
# processes it started (services, nats-server, rank processes), so two share a 2-core machine well.
TEST_WORKERS ?= 2

.PHONY: setup browser run test lint bench-cpu bench report fetch-model clean compose-config

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
	@# Hugging Face's `kernels` (a requirement of transformers 5.25+, which pyproject.toml excludes) has
	@# the import name of our kernels/ package; a venv that already got it drops it.
	@if $(PIP) show kernels 2>/dev/null | grep -q '^Summary: Download compute kernels'; then \
	  $(PIP) uninstall -q -y kernels; fi
	@touch $@

# The CPU single-row product (kernels/cpu/matvec.cpp), built with g++ and cached under ~/.cache/torch_extensions,
# so no Engine pays for the build. Never fails setup: without a compiler the engines keep torch's products.
$(VENV)/.cpu-kernels: $(VENV)/.installed kernels/cpu/matvec.cpp kernels/cpu_matvec.py
	@$(PY) -m kernels.cpu_matvec
	@touch $@

setup: $(VENV)/.installed $(VENV)/.cpu-kernels browser

# The playground's browser tests (tests/test_playground_browser.py) drive the system's Chromium through
# Playwright; Playwright's own browser download is not used. apt-get installs it where it can (as root,
# or with passwordless sudo); where it cannot, setup goes on and those tests skip, saying why.
browser:
	@if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then \
	  if ! command -v apt-get >/dev/null 2>&1; then \
	    echo "setup: no chromium and no apt-get; the playground's browser tests will skip"; \
	  else \
	    apt="env DEBIAN_FRONTEND=noninteractive apt-get"; if [ "$$(id -u)" -ne 0 ]; then apt="sudo -n $$apt"; fi; \
	    echo "setup: installing chromium with apt-get"; \
	    { $$apt install -y -q chromium >/dev/null 2>&1 || \
	      { $$apt update -q >/dev/null 2>&1 && $$apt install -y -q chromium >/dev/null 2>&1; }; } || \
	      echo "setup: apt-get could not install chromium; the playground's browser tests will skip"; \
	  fi; \
	fi

fetch-model: setup
	@$(VENV)/bin/radixserve model fetch

# NATS (RS_NATS_URL if it answers, else a local nats-server), tokenizer, worker + detokenizer and the
# gateway; prints the URL. PORT=8000 by default; extra engine flags go in RUN_ARGS.
PORT ?= 8000
RUN_ARGS ?=
run: fetch-model
	@$(VENV)/bin/radixserve up --port $(PORT) $(RUN_ARGS)

# One compute thread per Engine (OMP_NUM_THREADS=1 unless set): TEST_WORKERS pytest processes already
# fill the cores, and an offline Engine would otherwise take every core (cpu_reserved_cores 0), putting
# two spinning OpenMP teams on two vCPUs (make test went from 12 to 14.5 min that way).
test: setup
	@OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -q -x -n $(TEST_WORKERS) --dist loadfile --durations=15 $(PYTEST_ARGS)

# docker-compose.yml checked by `docker-compose config -q` (Debian's docker-compose is installed when
# missing and apt-get may run) and against the compose-spec schema; tests/test_deploy_compose.py.
compose-config: setup
	@if ! command -v docker-compose >/dev/null 2>&1 && ! docker compose version >/dev/null 2>&1; then \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then apt-get install -y -q docker-compose >/dev/null || true; fi; \
	fi
	@$(PY) -m pytest -q tests/test_deploy_compose.py

lint: setup
	@$(VENV)/bin/ruff check services shared kernels tests bench ops

# The figures of bench/RESULTS.md. Each script prints its figures and writes JSON; a run becomes a
# current figure once its JSON is copied to bench/results/<benchmark>_<date>_<letter>.json and its row
# in bench/current.py points at it (bench/report.py then rewrites the page and the plots).
bench-cpu: fetch-model
	@$(PY) bench/cpu_scheduler.py
	@$(PY) bench/cpu_decode.py
	@$(PY) bench/cpu_spec.py
	@$(PY) bench/grammar.py
	@$(PY) bench/pipeline_overhead.py
	@$(PY) bench/report.py

# GPU figures: on a host with a CUDA device the GPU scripts run here (JSON in bench/out/); elsewhere it
# says how to run them on the device. Then the page from the recorded JSON either way.
GPU_OUT ?= bench/out
bench: setup
	@if $(PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then \
	  mkdir -p $(GPU_OUT) && export OUT=$(GPU_OUT) && set -e; \
	  $(PY) bench/gpu_engine.py --models 0.6b,8b --skip-hf; \
	  $(PY) bench/gpu_cuda_graph.py; \
	  $(PY) bench/gpu_kernels.py; \
	  $(PY) -c "import torch; from bench.gpu_common import build_checkpoint; build_checkpoint('0.6b', torch.bfloat16)"; \
	  $(PY) bench/gpu_serving.py --figures p3,p4,p5,p6; \
	  $(PY) bench/gpu_spec.py --k 3 --eps 0.1,0.06,0.045,0.03,0.025,0.02; \
	  $(PY) bench/gpu_pipeline.py --gateways 4 --repeats 2 --ttft-runs 60 --text-runs 30; \
	  if [ "$$(nvidia-smi -L | wc -l)" -ge 2 ]; then $(PY) bench/gpu_tp.py; fi; \
	else \
	  echo "No CUDA device here. On the device machine, one call per few steps (each call <= 600 s):"; \
	  echo "  bash bench/gpu_session.sh engine graphs kernels     (.whl/ carried)"; \
	  echo "  FIGURES=p3,p4,p5,p6 bash bench/gpu_session.sh serving"; \
	  echo "  SPEC_K=3 SPEC_ARGS='--eps 0.1,0.06,0.045,0.03,0.025,0.02' bash bench/gpu_session.sh spec"; \
	  echo "  PIPELINE_ARGS='--gateways 4 --repeats 2 --ttft-runs 60 --text-runs 30' bash bench/gpu_session.sh pipeline  (.whl-pipeline/ too)"; \
	  echo "  bash bench/gpu_session.sh tp                        (nvidia-h200-x2)"; \
	  echo "then copy the JSON it returns into bench/results/ by benchmark and date and point bench/current.py at it."; \
	fi
	@$(PY) bench/report.py

# bench/RESULTS.md and bench/plots/ from bench/current.py and the JSON in bench/results/.
report: setup
	@$(PY) bench/report.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis

# gRPC stubs from proto/*.proto into services/gateway/proto_gen/ (gitignored; the gateway also
# regenerates them on import when they are missing or older than their .proto).
.PHONY: proto
proto: setup
	@$(PY) -m services.gateway.protos
